//! The accounts executions and file requests act as (`Exec.user` and the file requests' `user`).
//!
//! Names are looked up in the guest's `/etc/passwd` and `/etc/group` at every request (the
//! files are small, and an image may add accounts). Any account but root gets no capabilities
//! when it runs (see `sys::prepare_child`); file requests take its file-system ids for their
//! duration (see `sys::FsIds`). Once the sandbox's policy keeps root out of reach
//! ([`Users::forbid_root`], Reseed's `no_root`), accounts with uid 0 are refused and every other
//! one is locked down (an empty bounding set and no_new_privs: setuid binaries such as sudo give
//! nothing).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use airlock_proto::pb::ErrorCode;

use crate::error::ReqError;

/// The account executions run as by default in a VM (the base image's unprivileged user).
pub const DEFAULT_VM_USER: &str = "user";
/// Longest account name accepted (the usual `LOGIN_NAME_MAX` of useradd).
const MAX_NAME_BYTES: usize = 32;
/// Most supplementary groups taken from /etc/group (the kernel's NGROUPS_MAX is 65536).
const MAX_GROUPS: usize = 64;

/// An account from /etc/passwd, with its /etc/group memberships.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (its primary group first).
    pub groups: Vec<u32>,
    pub home: String,
    /// Its processes can never regain root: they empty their capability bounding set and set
    /// no_new_privs (the sandbox's no_root). Otherwise a setuid binary (sudo) may make them root.
    pub lock_down: bool,
}

impl Account {
    /// Root keeps every privilege; every other account drops them.
    pub fn is_root(&self) -> bool {
        self.uid == 0
    }
}

/// The account of an empty `user` (none: the agent's own, no switch) — as in an image's `User`:
/// a name or uid, optionally with `:GROUP` (a name or gid) as the primary group — and the
/// working directory of executions that name none (an image's `WorkingDir`, where it is a
/// directory; none: the account's home).
#[derive(Debug, Default)]
struct Defaults {
    user: Option<String>,
    workdir: Option<String>,
}

/// Where accounts come from, and which one an empty `user` means.
#[derive(Debug, Clone)]
pub struct Users {
    /// The defaults, shared by clones (a Reseed may set them).
    defaults: Arc<RwLock<Defaults>>,
    passwd: PathBuf,
    group: PathBuf,
    /// Root is out of reach (set once, never cleared).
    no_root: Arc<AtomicBool>,
}

impl Users {
    /// Accounts of this machine's `/etc/passwd` and `/etc/group`.
    pub fn new(default: Option<String>) -> Self {
        Self::with_files(default, Path::new("/etc/passwd"), Path::new("/etc/group"))
    }

    pub fn with_files(default: Option<String>, passwd: &Path, group: &Path) -> Self {
        Self {
            defaults: Arc::new(RwLock::new(Defaults {
                user: default,
                workdir: None,
            })),
            passwd: passwd.to_path_buf(),
            group: group.to_path_buf(),
            no_root: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The same, with `workdir` as the default working directory.
    pub fn with_workdir(self, workdir: Option<String>) -> Self {
        self.set_defaults(None, workdir);
        self
    }

    /// Replaces the default account and working directory (each only where given): a
    /// template's (its image's `User` and `WorkingDir`, a Dockerfile's `USER` and `WORKDIR`).
    pub fn set_defaults(&self, user: Option<String>, workdir: Option<String>) {
        let mut d = self.defaults.write().unwrap_or_else(|e| e.into_inner());
        if user.is_some() {
            d.user = user;
        }
        if workdir.is_some() {
            d.workdir = workdir;
        }
    }

    /// The working directory of executions that name none, if one is set.
    pub fn workdir(&self) -> Option<String> {
        let d = self.defaults.read().unwrap_or_else(|e| e.into_inner());
        d.workdir.clone()
    }

    /// The account of an empty `user`, if one is set.
    pub fn default_user(&self) -> Option<String> {
        let d = self.defaults.read().unwrap_or_else(|e| e.into_inner());
        d.user.clone()
    }

    /// Keeps root out of reach from now on: accounts with uid 0 (and the agent's own account,
    /// for a request that names none) are refused, and every other account is locked down.
    pub fn forbid_root(&self) {
        self.no_root.store(true, Ordering::SeqCst);
    }

    /// Whether root is out of reach.
    pub fn root_forbidden(&self) -> bool {
        self.no_root.load(Ordering::SeqCst)
    }

    /// The account a request with `user` acts as; `None`: the agent's own (an empty `user`
    /// without a default).
    pub fn resolve(&self, user: &str) -> Result<Option<Account>, ReqError> {
        let no_root = self.root_forbidden();
        let default = self.default_user();
        let name = match (user, &default) {
            ("", None) if no_root => return Err(root_refused("the agent's own account")),
            ("", None) => return Ok(None),
            ("", Some(d)) => d.as_str(),
            (u, _) => u,
        };
        let (name, primary) = match name.split_once(':') {
            Some((u, g)) => (u, Some(g)),
            None => (name, None),
        };
        check_name(name)?;
        if let Some(g) = primary {
            check_name(g)?;
        }
        let read = |p: &Path| {
            std::fs::read_to_string(p)
                .map_err(|e| ReqError::io(&format!("reading {}", p.display()), &e))
        };
        let passwd = read(&self.passwd)?;
        // A missing /etc/group leaves only the primary group.
        let group = std::fs::read_to_string(&self.group).unwrap_or_default();
        let mut account = find(&passwd, &group, name)
            .or_else(|| by_uid(&passwd, &group, name))
            .ok_or_else(|| {
                ReqError::new(
                    ErrorCode::NotFound,
                    format!("no account {name:?} in the guest's /etc/passwd"),
                )
            })?;
        if let Some(g) = primary {
            let gid = g
                .parse::<u32>()
                .ok()
                .or_else(|| group_id(&group, g))
                .ok_or_else(|| {
                    ReqError::new(
                        ErrorCode::NotFound,
                        format!("no group {g:?} in the guest's /etc/group"),
                    )
                })?;
            account.gid = gid;
            account.groups = vec![gid];
        }
        if no_root {
            if account.is_root() {
                return Err(root_refused(&format!("account {name:?} (uid 0)")));
            }
            account.lock_down = true;
        }
        Ok(Some(account))
    }
}

/// A numeric `user` (an image's `User: "1000"`): its /etc/passwd entry if one has that uid, else
/// the bare uid with group 0 and `/` as home, as container runtimes run it.
fn by_uid(passwd: &str, group: &str, user: &str) -> Option<Account> {
    let uid: u32 = user.parse().ok()?;
    let named = passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() >= 7 && f[2].parse() == Ok(uid)).then(|| f[0].to_owned())
    });
    if let Some(name) = named {
        return find(passwd, group, &name);
    }
    Some(Account {
        name: user.to_owned(),
        uid,
        gid: 0,
        groups: vec![0],
        home: "/".into(),
        lock_down: false,
    })
}

/// The gid of group `name` in the text of /etc/group.
fn group_id(group: &str, name: &str) -> Option<u32> {
    group.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() >= 3 && f[0] == name)
            .then(|| f[2].parse().ok())
            .flatten()
    })
}

fn root_refused(what: &str) -> ReqError {
    ReqError::new(
        ErrorCode::PermissionDenied,
        format!("{what}: root is out of reach in this sandbox (its policy sets no_root)"),
    )
}

fn check_name(name: &str) -> Result<(), ReqError> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
    let valid = !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && !name.starts_with('-')
        && name.chars().all(ok_char);
    if valid {
        Ok(())
    } else {
        Err(ReqError::invalid(format!(
            "invalid user name {name:?} (letters, digits, '_', '-', '.'; at most {MAX_NAME_BYTES} bytes)"
        )))
    }
}

/// `name`'s account in the texts of /etc/passwd and /etc/group.
pub fn find(passwd: &str, group: &str, name: &str) -> Option<Account> {
    let (uid, gid, home) = passwd.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        (f.len() >= 7 && f[0] == name).then(|| (f[2].parse().ok(), f[3].parse().ok(), f[5]))
    })?;
    let (uid, gid): (u32, u32) = (uid?, gid?);
    let mut groups = vec![gid];
    for line in group.lines() {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 4 || !f[3].split(',').any(|m| m == name) {
            continue;
        }
        if let Ok(g) = f[2].parse::<u32>()
            && !groups.contains(&g)
            && groups.len() < MAX_GROUPS
        {
            groups.push(g);
        }
    }
    Some(Account {
        name: name.to_owned(),
        uid,
        gid,
        groups,
        home: home.to_owned(),
        lock_down: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n\
        user:x:1000:1000:Airlock sandbox:/home/user:/bin/sh\n\
        broken:x:zero:0::/:/bin/sh\n";
    const GROUP: &str = "root:x:0:\nuser:x:1000:\naudio:x:29:user,other\nvideo:x:44:other\n";

    #[test]
    fn an_account_has_its_ids_home_and_memberships() {
        let user = find(PASSWD, GROUP, "user").unwrap();
        assert_eq!((user.uid, user.gid), (1000, 1000));
        assert_eq!(user.groups, [1000, 29]);
        assert_eq!(user.home, "/home/user");
        assert!(!user.is_root());
        assert!(find(PASSWD, GROUP, "root").unwrap().is_root());
    }

    #[test]
    fn unknown_and_malformed_accounts_are_not_found() {
        assert_eq!(find(PASSWD, GROUP, "nobody"), None);
        assert_eq!(find(PASSWD, GROUP, "broken"), None);
        assert_eq!(find(PASSWD, GROUP, "us"), None);
    }

    /// Users reading PASSWD and GROUP from files in a directory of the caller's own: tests run
    /// in parallel, and one rewriting a file another reads makes the reader see it empty.
    fn users(default: Option<&str>) -> (PathBuf, Users) {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "airlock-agent-users-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("passwd"), PASSWD).unwrap();
        std::fs::write(dir.join("group"), GROUP).unwrap();
        let u = Users::with_files(
            default.map(String::from),
            &dir.join("passwd"),
            &dir.join("group"),
        );
        (dir, u)
    }

    #[test]
    fn empty_means_the_default_or_the_agent_itself() {
        let (_d, with) = users(Some("user"));
        assert_eq!(with.resolve("").unwrap().unwrap().uid, 1000);
        assert_eq!(with.resolve("root").unwrap().unwrap().uid, 0);
        let (_d, without) = users(None);
        assert_eq!(without.resolve("").unwrap(), None);
    }

    #[test]
    fn without_root_uid_0_is_refused_and_the_rest_locked_down() {
        let (_d, u) = users(Some("user"));
        assert!(!u.resolve("").unwrap().unwrap().lock_down);
        let shared = u.clone();
        u.forbid_root();
        assert!(shared.root_forbidden(), "clones share the policy");
        let user = shared.resolve("").unwrap().unwrap();
        assert_eq!((user.uid, user.lock_down), (1000, true));
        let refused = shared.resolve("root").unwrap_err();
        assert_eq!(refused.code, ErrorCode::PermissionDenied);
        assert!(refused.message.contains("no_root"), "{}", refused.message);
        let (_d, own) = users(None);
        own.forbid_root();
        assert_eq!(
            own.resolve("").unwrap_err().code,
            ErrorCode::PermissionDenied
        );
    }

    #[test]
    fn a_template_sets_the_defaults_for_every_clone_of_the_agent() {
        let (_d, u) = users(Some("user"));
        let shared = u.clone();
        u.set_defaults(Some("root".into()), Some("/srv".into()));
        assert_eq!(
            shared.resolve("").unwrap().unwrap().uid,
            0,
            "clones share the defaults"
        );
        assert_eq!(shared.workdir().as_deref(), Some("/srv"));
        u.set_defaults(None, None);
        assert_eq!(
            u.default_user().as_deref(),
            Some("root"),
            "None leaves them as they are"
        );
    }

    #[test]
    fn an_image_user_may_be_a_uid_and_name_its_primary_group() {
        let (_d, u) = users(None);
        let by_uid = u.resolve("1000").unwrap().unwrap();
        assert_eq!(
            (by_uid.name.as_str(), by_uid.home.as_str()),
            ("user", "/home/user")
        );
        let bare = u.resolve("4321").unwrap().unwrap();
        assert_eq!((bare.uid, bare.gid, bare.home.as_str()), (4321, 0, "/"));
        let grouped = u.resolve("user:audio").unwrap().unwrap();
        assert_eq!(
            (grouped.uid, grouped.gid, grouped.groups.clone()),
            (1000, 29, vec![29])
        );
        assert_eq!(u.resolve("4321:77").unwrap().unwrap().gid, 77);
        assert_eq!(
            u.resolve("user:nogroup").unwrap_err().code,
            ErrorCode::NotFound
        );
    }

    #[test]
    fn bad_names_are_invalid_and_unknown_ones_not_found() {
        let (_d, u) = users(None);
        for bad in ["-x", "a::b", ":g", "a/b", "a b", &"x".repeat(33)] {
            assert_eq!(u.resolve(bad).unwrap_err().code, ErrorCode::InvalidArgument);
        }
        assert_eq!(u.resolve("ghost").unwrap_err().code, ErrorCode::NotFound);
    }
}
