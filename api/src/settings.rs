//! Access to the `settings` of AddDiskRequest and DiskConfig, which protobuf makes optional:
//! absent means every setting at its zero value (the defaults, in a request).

use crate::pb::{AddDiskRequest, DiskConfig, DiskSettings};

impl AddDiskRequest {
    /// A request for disk `id` on `image` with every other setting at its default.
    pub fn with_image(id: impl Into<String>, image: impl Into<String>) -> Self {
        AddDiskRequest {
            id: id.into(),
            settings: Some(DiskSettings {
                image: image.into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// The settings, added (all zero) if absent, to fill in.
    pub fn settings_mut(&mut self) -> &mut DiskSettings {
        self.settings.get_or_insert_with(Default::default)
    }

    /// A copy of the settings; all zero (every default) if absent.
    pub fn settings_or_default(&self) -> DiskSettings {
        self.settings.clone().unwrap_or_default()
    }
}

impl DiskConfig {
    /// A copy of the settings; all zero if absent (which blkplaned never sends).
    pub fn settings_or_default(&self) -> DiskSettings {
        self.settings.clone().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_settings_are_added_once() {
        let mut r = AddDiskRequest::default();
        r.settings_mut().image = "/i".into();
        r.settings_mut().num_queues = 2;
        let s = r.settings.unwrap();
        assert_eq!((s.image.as_str(), s.num_queues), ("/i", 2));
        assert_eq!(
            DiskConfig::default().settings_or_default(),
            DiskSettings::default()
        );
    }
}
