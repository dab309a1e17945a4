//! An incoming disk (AddDiskRequest `incoming_for`) against its migration source: the source
//! must exist and may be migrated now, and what the guest sees is the source's.

use std::path::Path;

use super::disk::image_identity;
use super::{check_id_in, invalid, ValidationError};
use crate::pb::{AddDiskRequest, DiskSettings, ImageFormat};
use crate::state::{DiskSpec, MigrationStorage, RemoteSource};
use blkplane_api::endpoint::HostPort;
use blkplane_api::names::format_name;

/// The source disk of an incoming disk, as [`resolve_incoming`] needs to see it.
#[derive(Debug, Clone, Copy)]
pub struct MigrationSource<'a> {
    /// Its configuration now; its `incoming_for` says whether it is itself still incoming.
    pub spec: &'a DiskSpec,
    /// The id of the disk that already is its incoming destination, if there is one.
    pub incoming: Option<&'a str>,
    /// Its migration blockers now, one `reason: message` line each.
    pub blockers: &'a [String],
}

/// Checks `incoming_for` of an AddDisk request against the disk it names (`source`: `None`
/// when no disk has that id) and returns the request with the fields the guest sees taken
/// from the source where the request leaves them zero or empty: the image, `format`,
/// `read_only`, `serial`, `num_queues`, `queue_size`, `block_size`. A value the request does set must be
/// the source's, because the migrated guest must find the same device; the image may be
/// named by another path, but must be the same file. A request without `incoming_for` is
/// returned as it is. [`check_add`] then checks the result like any request.
pub fn resolve_incoming(
    req: &AddDiskRequest,
    source: Option<MigrationSource<'_>>,
) -> Result<AddDiskRequest, ValidationError> {
    const F: &str = "incoming_for";
    if req.incoming_for.is_empty() {
        return Ok(req.clone());
    }
    check_id_in(F, &req.incoming_for)?;
    if req.incoming_for == req.id {
        return Err(invalid(
            F,
            format!(
                "{:?} is this disk's own id; name the disk it takes over from",
                req.id
            ),
        ));
    }
    let Some(source) = source else {
        return Err(ValidationError::NotFound {
            field: F,
            reason: format!("no disk named {:?}", req.incoming_for),
        });
    };
    let src = source.spec;
    let name = &src.id;
    if let Some(its_source) = &src.incoming_for {
        return Err(ValidationError::FailedPrecondition {
            field: F,
            reason: format!(
                "disk {name} is itself the incoming destination of a migration of disk \
                 {its_source}; it has to take over before it can be migrated on"
            ),
        });
    }
    if let Some(other) = source.incoming {
        return Err(ValidationError::FailedPrecondition {
            field: F,
            reason: format!(
                "disk {name} already has an incoming disk, {other}; remove {other} to start \
                 another migration"
            ),
        });
    }
    // The destination's frontend is what a migration needs first (its VMM connects to it):
    // refusing it is how a blocked migration fails before any VMM is involved, with every
    // QEMU (10.0 aborts when a back-end refuses to start dirty logging).
    if !source.blockers.is_empty() {
        return Err(ValidationError::FailedPrecondition {
            field: F,
            reason: format!(
                "disk {name} must not be migrated now: {}",
                source.blockers.join("; ")
            ),
        });
    }
    let asked = req.settings.clone().unwrap_or_default();
    let mut settings = asked.clone();
    let src_image = src.image.to_string_lossy();
    if asked.image.is_empty() {
        settings.image = src_image.into_owned();
    } else if Path::new(&asked.image).is_absolute() {
        // Only a file that exists can be compared; check_add reports any other problem with
        // the path in its own words.
        if let Some(identity) = image_identity(Path::new(&asked.image)) {
            if image_identity(&src.image) != Some(identity) {
                return Err(invalid(
                    "settings.image",
                    format!(
                        "{} is not the image of disk {name} ({src_image}); an incoming disk \
                         serves its source's image (leave it empty to take it)",
                        asked.image
                    ),
                ));
            }
        }
    }
    let device = src.to_pb().settings.unwrap_or_default();
    take_device(req, &asked, settings, &device, name)
}

/// Checks the form of AddDiskRequest `incoming_from` (the source node itself is asked by the
/// caller) and returns it as stored, this node named `node`, with the endpoint parsed;
/// `None` without it.
pub fn check_incoming_from(
    req: &AddDiskRequest,
    node: &str,
) -> Result<Option<(RemoteSource, HostPort)>, ValidationError> {
    let Some(from) = &req.incoming_from else {
        return Ok(None);
    };
    if !req.incoming_for.is_empty() {
        return Err(invalid(
            "incoming_from",
            "set together with incoming_for: a disk migrates from one source, on this node \
             (incoming_for) or on another (incoming_from)",
        ));
    }
    let endpoint = HostPort::parse(&from.endpoint).ok_or_else(|| {
        invalid(
            "incoming_from.endpoint",
            format!(
                "{:?} is not HOST:PORT (HOST a name, an IPv4 address or [IPv6]; PORT 1 to \
                 65535): the source node's blkplaned, as its --listen tcp: serves",
                from.endpoint
            ),
        )
    })?;
    check_id_in("incoming_from.disk", &from.disk)?;
    let storage = match MigrationStorage::from_pb(from.storage) {
        Some(MigrationStorage::Shared) => MigrationStorage::Shared,
        Some(MigrationStorage::Local) => {
            let image = req
                .settings
                .as_ref()
                .map(|s| s.image.as_str())
                .unwrap_or("");
            if image.is_empty() || !Path::new(image).is_absolute() {
                return Err(invalid(
                    "settings.image",
                    format!(
                        "{image:?}: with local storage, the absolute path of the new image \
                         on this node is required (blkplaned creates it; it must not exist)"
                    ),
                ));
            }
            MigrationStorage::Local
        }
        None => {
            return Err(invalid(
                "incoming_from.storage",
                format!(
                    "{} is not shared or local: say how the disk's contents reach this node",
                    from.storage
                ),
            ))
        }
    };
    Ok(Some((
        RemoteSource {
            endpoint: endpoint.to_string(),
            disk: from.disk.clone(),
            storage,
            as_node: node.to_string(),
            image_incomplete: storage == MigrationStorage::Local,
        },
        endpoint,
    )))
}

/// An incoming disk from another node (`incoming_from`, already checked by
/// [`check_incoming_from`]) against its source there, `source` as that node's blkplaned
/// described it when it agreed to the migration: the request with what the guest sees taken
/// from the source where the request leaves it zero or empty (as [`resolve_incoming`] does)
/// and, for shared storage, the image: the request's path (the image as this node names
/// it) or the source's. That it is the same image is checked by its size against the
/// source's capacity, by the caller, once the path is checked.
pub fn resolve_remote_incoming(
    req: &AddDiskRequest,
    from: &RemoteSource,
    source: &crate::pb::Disk,
) -> Result<AddDiskRequest, ValidationError> {
    // What the other node answered is checked like any input: it must describe the disk
    // asked for, and record this node as its destination.
    let odd = |what: String| ValidationError::FailedPrecondition {
        field: "incoming_from",
        reason: format!("the blkplaned at {} answered for {what}", from.endpoint),
    };
    let config = source
        .config
        .as_ref()
        .ok_or_else(|| odd("no disk (no configuration)".into()))?;
    if config.id != from.disk {
        return Err(odd(format!("disk {:?}, not {:?}", config.id, from.disk)));
    }
    let recorded = config.outgoing.as_ref();
    if recorded.is_none_or(|o| o.node != from.as_node || o.disk != req.id) {
        return Err(odd(format!(
            "disk {} without a migration to disk {} on node {} recorded",
            from.disk, req.id, from.as_node
        )));
    }
    let src = config.settings.clone().unwrap_or_default();
    let asked = req.settings.clone().unwrap_or_default();
    let mut settings = asked.clone();
    if asked.image.is_empty() {
        settings.image = src.image.clone();
    }
    take_device(req, &asked, settings, &src, &from.to_string())
}

/// The request with the settings the guest sees (`read_only`, `serial`, `num_queues`,
/// `queue_size`, `block_size`, `format`) taken from the migration source's settings `src`
/// (the source named `name` in messages) into `settings` where `asked` leaves them zero or
/// empty; a value `asked` does set must be the source's.
fn take_device(
    req: &AddDiskRequest,
    asked: &DiskSettings,
    mut settings: DiskSettings,
    src: &DiskSettings,
    name: &str,
) -> Result<AddDiskRequest, ValidationError> {
    // A value set in the request must be the source's; zero or empty takes the source's.
    let differs = |field: &'static str, requested: String, source: String| {
        invalid(
            field,
            format!(
                "{requested} differs from {source} of disk {name}, the migration source; the \
                 migrated guest must find the same device (leave it unset to take the \
                 source's)"
            ),
        )
    };
    if asked.read_only && !src.read_only {
        return Err(invalid(
            "settings.read_only",
            format!(
                "set, but disk {name}, the migration source, is writable; the migrated guest \
                 must find the same device (leave it unset to take the source's)"
            ),
        ));
    }
    settings.read_only = src.read_only;
    if !asked.serial.is_empty() && asked.serial != src.serial {
        return Err(differs(
            "settings.serial",
            format!("{:?}", asked.serial),
            format!("{:?}", src.serial),
        ));
    }
    settings.serial = src.serial.clone();
    for (field, requested, source, slot) in [
        (
            "settings.num_queues",
            asked.num_queues,
            src.num_queues,
            &mut settings.num_queues,
        ),
        (
            "settings.queue_size",
            asked.queue_size,
            src.queue_size,
            &mut settings.queue_size,
        ),
        (
            "settings.block_size",
            asked.block_size,
            src.block_size,
            &mut settings.block_size,
        ),
    ] {
        if requested != 0 && requested != source {
            return Err(differs(field, requested.to_string(), source.to_string()));
        }
        *slot = source;
    }
    // The source's kept format; one kept from before formats were (UNSPECIFIED) is probed
    // again by check_add, on the same image.
    if let Ok(format) = ImageFormat::try_from(src.format) {
        if format != ImageFormat::Unspecified && asked.format != 0 && asked.format != format as i32
        {
            let asked_name = ImageFormat::try_from(asked.format)
                .map(format_name)
                .unwrap_or("an unknown format");
            return Err(differs(
                "settings.format",
                asked_name.to_string(),
                format_name(format).to_string(),
            ));
        }
        if format != ImageFormat::Unspecified {
            settings.format = format as i32;
        }
    }
    Ok(AddDiskRequest {
        settings: Some(settings),
        ..req.clone()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::DiskSettings;
    use crate::validate::check_add;
    use crate::validate::disk::tests::{ctx, request, Tmp};

    fn source_spec(tmp: &Tmp) -> DiskSpec {
        let mut r = request(tmp);
        r.id = "src".into();
        r.settings_mut().read_only = true;
        r.settings_mut().serial = "SER-1".into();
        r.settings_mut().num_queues = 4;
        r.settings_mut().queue_size = 128;
        r.settings_mut().block_size = 4096;
        check_add(&r, &ctx(tmp)).unwrap().0
    }

    #[test]
    fn incoming_takes_the_source_device() {
        let tmp = Tmp::new("incoming");
        let c = ctx(&tmp);
        let src = source_spec(&tmp);
        let source = Some(MigrationSource {
            spec: &src,
            incoming: None,
            blockers: &[],
        });
        let req = AddDiskRequest {
            id: "dst".into(),
            incoming_for: "src".into(),
            incoming_from: None,
            settings: Some(DiskSettings {
                iothreads: 2,
                ..Default::default()
            }),
        };
        // Empty and zero: everything the guest sees comes from the source; the iothreads
        // (not seen by the guest) are the request's own.
        let resolved = resolve_incoming(&req, source).unwrap();
        let (spec, identity) = check_add(&resolved, &c).unwrap();
        assert_eq!(spec.image, src.image);
        assert_eq!((spec.read_only, spec.serial.as_str()), (true, "SER-1"));
        assert_eq!(
            (
                spec.num_queues,
                spec.queue_size,
                spec.block_size,
                spec.iothreads
            ),
            (4, 128, 4096, 2)
        );
        assert_eq!(spec.incoming_for.as_deref(), Some("src"));
        assert_eq!(spec.vhost_socket, tmp.path().join("disks/dst.sock"));
        assert_eq!(image_identity(&src.image), Some(identity));
        // The same values spelled out, and the image by another path, are fine too.
        let link = tmp.path().join("link.img");
        std::os::unix::fs::symlink(&src.image, &link).unwrap();
        let same = AddDiskRequest {
            settings: Some(DiskSettings {
                image: link.to_str().unwrap().into(),
                read_only: true,
                serial: "SER-1".into(),
                num_queues: 4,
                queue_size: 128,
                block_size: 4096,
                ..req.clone().settings.clone().unwrap_or_default()
            }),
            ..req.clone()
        };
        let (spec, _) = check_add(&resolve_incoming(&same, source).unwrap(), &c).unwrap();
        assert_eq!(spec.image, link);
        // An ordinary request passes through untouched.
        let plain = request(&tmp);
        assert_eq!(resolve_incoming(&plain, None).unwrap(), plain);
        assert_eq!(check_add(&plain, &c).unwrap().0.incoming_for, None);
    }

    #[test]
    fn incoming_rules() {
        let tmp = Tmp::new("incrules");
        let src = source_spec(&tmp);
        let source = Some(MigrationSource {
            spec: &src,
            incoming: None,
            blockers: &[],
        });
        let base = AddDiskRequest {
            id: "dst".into(),
            incoming_for: "src".into(),
            ..Default::default()
        };
        let with = |f: &dyn Fn(&mut AddDiskRequest)| {
            let mut r = base.clone();
            f(&mut r);
            resolve_incoming(&r, source)
        };
        let other = tmp.path().join("other.img");
        std::fs::File::create(&other)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let invalid_field = |r: Result<AddDiskRequest, ValidationError>| match r {
            Err(ValidationError::Invalid { field, reason }) => {
                assert!(!reason.is_empty());
                field
            }
            other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
        };
        assert_eq!(
            invalid_field(with(
                &|r| r.settings_mut().image = other.to_str().unwrap().into()
            )),
            "settings.image"
        );
        assert_eq!(
            invalid_field(with(&|r| r.settings_mut().serial = "SER-2".into())),
            "settings.serial"
        );
        assert_eq!(
            invalid_field(with(&|r| r.settings_mut().num_queues = 2)),
            "settings.num_queues"
        );
        assert_eq!(
            invalid_field(with(&|r| r.settings_mut().queue_size = 256)),
            "settings.queue_size"
        );
        assert_eq!(
            invalid_field(with(&|r| r.settings_mut().block_size = 512)),
            "settings.block_size"
        );
        assert_eq!(
            invalid_field(with(&|r| r.incoming_for = "a/b".into())),
            "incoming_for"
        );
        assert_eq!(
            invalid_field(with(&|r| r.incoming_for = "dst".into())),
            "incoming_for"
        );
        // The format: the source's kept one is taken; another is refused.
        assert_eq!(src.format, Some(crate::state::Format::Raw));
        assert_eq!(
            with(&|_| {}).unwrap().settings_or_default().format,
            ImageFormat::Raw as i32
        );
        assert_eq!(
            invalid_field(with(
                &|r| r.settings_mut().format = ImageFormat::Qcow2 as i32
            )),
            "settings.format"
        );
        assert!(with(&|r| r.settings_mut().format = ImageFormat::Raw as i32).is_ok());
        let e = with(&|r| r.settings_mut().num_queues = 2)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("settings.num_queues: 2 differs from 4 of disk src"),
            "{e}"
        );
        // read_only unset takes the source's; set on a writable source is refused.
        let mut writable = src.clone();
        writable.read_only = false;
        let ws = Some(MigrationSource {
            spec: &writable,
            incoming: None,
            blockers: &[],
        });
        let mut ro = base.clone();
        ro.settings_mut().read_only = true;
        assert_eq!(
            invalid_field(resolve_incoming(&ro, ws)),
            "settings.read_only"
        );
        // A missing image is check_add's to report (NOT_FOUND), not a mismatch.
        let missing = with(&|r| {
            r.settings_mut().image = tmp.path().join("gone.img").to_str().unwrap().into()
        });
        assert!(missing.is_ok(), "{missing:?}");
        // No such disk; a source that is incoming itself, or already has an incoming disk.
        assert!(matches!(
            resolve_incoming(&base, None),
            Err(ValidationError::NotFound {
                field: "incoming_for",
                ..
            })
        ));
        let mut incoming_src = src.clone();
        incoming_src.incoming_for = Some("older".into());
        let e = resolve_incoming(
            &base,
            Some(MigrationSource {
                spec: &incoming_src,
                incoming: None,
                blockers: &[],
            }),
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                ValidationError::FailedPrecondition {
                    field: "incoming_for",
                    ..
                }
            ),
            "{e:?}"
        );
        let e = resolve_incoming(
            &base,
            Some(MigrationSource {
                spec: &src,
                incoming: Some("dst0"),
                blockers: &[],
            }),
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("already has an incoming disk, dst0"),
            "{e}"
        );
        assert_eq!(e.field(), "incoming_for");
        // A source that must not be migrated now gets no destination; the reasons are named.
        let blockers = ["operator_backup: nightly".to_string()];
        let e = resolve_incoming(
            &base,
            Some(MigrationSource {
                spec: &src,
                incoming: None,
                blockers: &blockers,
            }),
        )
        .unwrap_err();
        assert!(
            matches!(e, ValidationError::FailedPrecondition { .. }),
            "{e:?}"
        );
        assert_eq!(e.field(), "incoming_for");
        assert!(e.to_string().contains("operator_backup: nightly"), "{e}");
    }

    fn from(endpoint: &str, disk: &str, storage: MigrationStorage) -> crate::pb::IncomingFrom {
        crate::pb::IncomingFrom {
            endpoint: endpoint.into(),
            disk: disk.into(),
            storage: storage.to_pb() as i32,
        }
    }

    #[test]
    fn incoming_from_is_checked_field_by_field() {
        let req = |incoming_from| AddDiskRequest {
            id: "dst".into(),
            incoming_from: Some(incoming_from),
            ..Default::default()
        };
        let (source, endpoint) = check_incoming_from(
            &req(from("[fd00::1]:7070", "vd1", MigrationStorage::Shared)),
            "node-b",
        )
        .unwrap()
        .unwrap();
        assert_eq!(source.endpoint, "[fd00::1]:7070");
        assert_eq!((endpoint.host.as_str(), endpoint.port), ("fd00::1", 7070));
        assert_eq!(source.disk, "vd1");
        assert_eq!(
            check_incoming_from(&AddDiskRequest::default(), "n").unwrap(),
            None
        );
        for (bad, field) in [
            (
                from("node-a", "vd1", MigrationStorage::Shared),
                "incoming_from.endpoint",
            ),
            (
                from("node-a:7070/vd1", "vd1", MigrationStorage::Shared),
                "incoming_from.endpoint",
            ),
            (
                from("node-a:7070", "", MigrationStorage::Shared),
                "incoming_from.disk",
            ),
            (
                from("node-a:7070", "../x", MigrationStorage::Shared),
                "incoming_from.disk",
            ),
        ] {
            let e = check_incoming_from(&req(bad), "n").unwrap_err();
            assert!(matches!(e, ValidationError::Invalid { .. }), "{e:?}");
            assert_eq!(e.field(), field);
        }
        let unspecified = crate::pb::IncomingFrom {
            storage: 0,
            ..from("node-a:7070", "vd1", MigrationStorage::Shared)
        };
        assert_eq!(
            check_incoming_from(&req(unspecified), "n")
                .unwrap_err()
                .field(),
            "incoming_from.storage"
        );
        // Copying a local disk needs the new image's path here.
        let e = check_incoming_from(
            &req(from("node-a:7070", "vd1", MigrationStorage::Local)),
            "n",
        )
        .unwrap_err();
        assert_eq!(e.field(), "settings.image", "{e:?}");
        let local = AddDiskRequest {
            settings: Some(DiskSettings {
                image: "/images/new.img".into(),
                ..DiskSettings::default()
            }),
            ..req(from("node-a:7070", "vd1", MigrationStorage::Local))
        };
        let (source, _) = check_incoming_from(&local, "n").unwrap().unwrap();
        assert!(source.image_incomplete);
        // One source at a time.
        let both = AddDiskRequest {
            incoming_for: "a".into(),
            ..req(from("node-a:7070", "vd1", MigrationStorage::Shared))
        };
        assert_eq!(
            check_incoming_from(&both, "n").unwrap_err().field(),
            "incoming_from"
        );
    }

    #[test]
    fn a_remote_source_gives_its_device_and_path() {
        let tmp = Tmp::new("remote");
        let src = source_spec(&tmp);
        let remote = RemoteSource {
            endpoint: "node-a:7070".into(),
            disk: "src".into(),
            storage: MigrationStorage::Shared,
            as_node: "node-b".into(),
            image_incomplete: false,
        };
        let recorded = crate::pb::OutgoingMigration {
            node: "node-b".into(),
            disk: "dst".into(),
            storage: crate::pb::MigrationStorage::Shared as i32,
        };
        let described = crate::pb::Disk {
            config: Some(crate::pb::DiskConfig {
                outgoing: Some(recorded.clone()),
                ..src.to_pb()
            }),
            capacity_bytes: 1 << 20,
            ..Default::default()
        };
        let req = AddDiskRequest {
            id: "dst".into(),
            incoming_from: Some(remote.to_pb()),
            ..Default::default()
        };
        let resolved = resolve_remote_incoming(&req, &remote, &described).unwrap();
        let (spec, _) = check_add(&resolved, &ctx(&tmp)).unwrap();
        assert_eq!(spec.image, src.image);
        assert_eq!((spec.read_only, spec.serial.as_str()), (true, "SER-1"));
        assert_eq!(
            (spec.num_queues, spec.queue_size, spec.block_size),
            (4, 128, 4096)
        );
        assert_eq!(spec.incoming_from, Some(remote.clone()));
        // The image as this node names it is the request's; the device must be the source's,
        // named with the node in the message.
        let mut other = req.clone();
        other.settings_mut().image = "/elsewhere/src.img".into();
        let resolved = resolve_remote_incoming(&other, &remote, &described).unwrap();
        assert_eq!(resolved.settings.unwrap().image, "/elsewhere/src.img");
        let mut serial = req.clone();
        serial.settings_mut().serial = "OTHER".into();
        let e = resolve_remote_incoming(&serial, &remote, &described).unwrap_err();
        assert_eq!(e.field(), "settings.serial");
        assert!(e.to_string().contains("disk src on node-a:7070"), "{e}");
        // An answer about another disk, or one that does not record this destination.
        for odd in [
            crate::pb::Disk::default(),
            crate::pb::Disk {
                config: Some(crate::pb::DiskConfig {
                    id: "other".into(),
                    ..described.config.clone().unwrap()
                }),
                ..described.clone()
            },
            crate::pb::Disk {
                config: Some(crate::pb::DiskConfig {
                    outgoing: None,
                    ..described.config.clone().unwrap()
                }),
                ..described.clone()
            },
            crate::pb::Disk {
                config: Some(crate::pb::DiskConfig {
                    outgoing: Some(crate::pb::OutgoingMigration {
                        node: "node-c".into(),
                        ..recorded.clone()
                    }),
                    ..described.config.clone().unwrap()
                }),
                ..described.clone()
            },
        ] {
            let e = resolve_remote_incoming(&req, &remote, &odd).unwrap_err();
            assert!(
                matches!(e, ValidationError::FailedPrecondition { .. }),
                "{e:?}"
            );
            assert_eq!(e.field(), "incoming_from");
        }
    }
}
