//! What a blkplane binary says it is: the package version and the git commit it was built from
//! (`unknown` when built without git and without `BLKPLANE_GIT_COMMIT`; `-dirty` when tracked
//! files differed from the commit). Every binary's `--version` prints [`VERSION`], and
//! blkplaned answers `GetVersion` with it, so an operator can tell which build runs where.

#![warn(missing_docs)]

/// The git commit of the build: 12 hex digits, perhaps `-dirty`, or `unknown`.
pub const COMMIT: &str = env!("BLKPLANE_GIT_COMMIT");

/// The package version.
pub const PACKAGE_VERSION: &str = env!("CARGO_PKG_VERSION");

/// `--version`'s text: `0.1.0 (commit 0123456789ab)`.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("BLKPLANE_GIT_COMMIT"),
    ")"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_names_the_package_and_the_commit() {
        assert!(VERSION.starts_with(PACKAGE_VERSION));
        assert!(VERSION.contains(COMMIT));
        assert!(!COMMIT.is_empty());
    }
}
