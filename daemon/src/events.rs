//! Disk and process events, broadcast to every `WatchEvents` stream and logged.

use std::pin::Pin;

use log::info;
use tokio::sync::broadcast;
use tokio_stream::wrappers::errors::BroadcastStreamRecvError;
use tokio_stream::wrappers::BroadcastStream;
use tokio_stream::{Stream, StreamExt};

use crate::pb::{Event, EventKind};
use blkplane_api::names::kind_name;
use blkplane_api::time::unix_time_ms;

/// Events buffered per watcher; a watcher that falls further behind is told so and its
/// stream ends (it can watch again and re-read the disks).
pub const CAPACITY: usize = 1024;

/// The event broadcaster. Cheap to clone.
#[derive(Debug, Clone)]
pub struct EventBus {
    tx: broadcast::Sender<Event>,
}

impl Default for EventBus {
    fn default() -> Self {
        Self::new()
    }
}

/// A stream of events for one watcher, ending with an error if it fell behind.
pub type EventStream = Pin<Box<dyn Stream<Item = Result<Event, tonic::Status>> + Send>>;

impl EventBus {
    /// A bus without watchers.
    pub fn new() -> EventBus {
        EventBus {
            tx: broadcast::channel(CAPACITY).0,
        }
    }

    /// Publishes an event (and logs it). Having no watcher is fine.
    pub fn emit(&self, kind: EventKind, disk_id: &str, pid: u32, message: impl Into<String>) {
        let message = message.into();
        info!(
            "event {}: disk {disk_id}{}{}",
            kind_name(kind),
            if pid != 0 {
                format!(" pid {pid}")
            } else {
                String::new()
            },
            if message.is_empty() {
                String::new()
            } else {
                format!(": {message}")
            }
        );
        let _ = self.tx.send(Event {
            kind: kind as i32,
            disk_id: disk_id.to_string(),
            unix_time_ms: unix_time_ms(),
            pid,
            message,
        });
    }

    /// A receiver of every event from now on, for in-process consumers.
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.tx.subscribe()
    }

    /// A gRPC stream of every event from now on, for `disk_id` only unless it is empty.
    pub fn watch(&self, disk_id: String) -> EventStream {
        let stream = BroadcastStream::new(self.tx.subscribe())
            .filter(move |e| match e {
                Ok(ev) => disk_id.is_empty() || ev.disk_id == disk_id,
                Err(_) => true,
            })
            .map(|e| {
                e.map_err(|BroadcastStreamRecvError::Lagged(n)| {
                    tonic::Status::resource_exhausted(format!(
                        "this watcher fell {n} events behind; watch again"
                    ))
                })
            });
        // End the stream after a lag error: the watcher must not believe it saw everything.
        let mut failed = false;
        Box::pin(stream.take_while(move |item| {
            let keep = !failed;
            failed |= item.is_err();
            keep
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn filtered_watch() {
        let bus = EventBus::new();
        let mut all = bus.watch(String::new());
        let mut only_b = bus.watch("b".into());
        bus.emit(EventKind::Added, "a", 1, "");
        bus.emit(EventKind::Failed, "b", 2, "crashed");
        let e = all.next().await.unwrap().unwrap();
        assert_eq!((e.kind, e.disk_id.as_str()), (EventKind::Added as i32, "a"));
        let e = all.next().await.unwrap().unwrap();
        assert_eq!(e.disk_id, "b");
        let e = only_b.next().await.unwrap().unwrap();
        assert_eq!((e.kind, e.pid), (EventKind::Failed as i32, 2));
        assert_eq!(e.message, "crashed");
    }

    #[tokio::test]
    async fn lagging_watcher_is_told_and_ended() {
        let bus = EventBus::new();
        let mut w = bus.watch(String::new());
        for i in 0..CAPACITY + 10 {
            bus.emit(EventKind::Connected, "a", i as u32, "");
        }
        let first = w.next().await.unwrap();
        assert_eq!(first.unwrap_err().code(), tonic::Code::ResourceExhausted);
        assert!(w.next().await.is_none());
    }
}
