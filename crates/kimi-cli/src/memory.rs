//! How much host memory this process may still use: the smaller of the kernel's
//! `MemAvailable` and what the process's memory cgroup leaves (v2 `memory.max` minus
//! `memory.current`, v1 `memory.limit_in_bytes` minus `memory.usage_in_bytes`, each less
//! the reclaimable inactive page cache, as the kubelet counts a container's working set).
//! A container sees the host's `/proc/meminfo`, so without the cgroup a server in an 8 GiB
//! container on a 512 GiB host would plan for the host.

use std::path::{Path, PathBuf};

/// A cgroup's limit and what its processes use now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CgroupMemory {
    /// The smallest `memory.max` / `memory.limit_in_bytes` on the way to the root.
    pub limit: u64,
    /// Usage less inactive file pages.
    pub working_set: u64,
}

impl CgroupMemory {
    /// What the cgroup leaves.
    pub fn headroom(&self) -> u64 {
        self.limit.saturating_sub(self.working_set)
    }
}

/// The host's and the cgroup's view of free memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostMemory {
    /// `MemAvailable` of /proc/meminfo.
    pub available: Option<u64>,
    /// The memory cgroup, when it sets a limit.
    pub cgroup: Option<CgroupMemory>,
}

impl HostMemory {
    /// Reads /proc and /sys/fs/cgroup.
    pub fn read() -> Self {
        HostMemory {
            available: mem_available(Path::new("/proc/meminfo")),
            cgroup: std::fs::read_to_string("/proc/self/cgroup")
                .ok()
                .and_then(|text| cgroup_memory(&text, Path::new("/sys/fs/cgroup"))),
        }
    }

    /// Bytes this process may still take, if anything says.
    pub fn usable(&self) -> Option<u64> {
        let cgroup = self.cgroup.map(|c| c.headroom());
        match (self.available, cgroup) {
            (Some(a), Some(c)) => Some(a.min(c)),
            (a, c) => a.or(c),
        }
    }

    /// "12.3 GiB usable (cgroup limit 16 GiB)" for the start banner.
    pub fn describe(&self) -> String {
        let gib = |b: u64| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64);
        match (self.usable(), self.cgroup) {
            (Some(u), Some(c)) => format!("{} usable (cgroup limit {})", gib(u), gib(c.limit)),
            (Some(u), None) => format!("{} usable", gib(u)),
            (None, _) => "free memory unknown".into(),
        }
    }
}

/// `MemAvailable` in bytes.
fn mem_available(meminfo: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(meminfo).ok()?;
    let kb: u64 = text
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    kb.checked_mul(1024)
}

/// v1 writes "no limit" as a page-rounded `i64::MAX`; anything this large means none.
const UNLIMITED: u64 = 1 << 60;

/// The memory cgroup of a process whose `/proc/<pid>/cgroup` is `proc_cgroup`, under the
/// cgroup mount `root`; `None` without a limit. v1's `memory` controller line wins over
/// v2's `0::` line (a hybrid host mounts both, and only one has the controller).
pub fn cgroup_memory(proc_cgroup: &str, root: &Path) -> Option<CgroupMemory> {
    let mut v1 = None;
    let mut v2 = None;
    for line in proc_cgroup.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            v2 = Some(path);
        } else if controllers.split(',').any(|c| c == "memory") {
            v1 = Some(path);
        }
    }
    if let Some(path) = v1 {
        let files = Files {
            limit: "memory.limit_in_bytes",
            usage: "memory.usage_in_bytes",
            inactive: "total_inactive_file",
        };
        if let Some(found) = files.read(&root.join("memory"), path) {
            return Some(found);
        }
    }
    let files = Files {
        limit: "memory.max",
        usage: "memory.current",
        inactive: "inactive_file",
    };
    files.read(root, v2?)
}

/// The file names of one cgroup version.
struct Files {
    limit: &'static str,
    usage: &'static str,
    inactive: &'static str,
}

impl Files {
    /// Reads the cgroup at `path` (as /proc shows it) under `mount`. Inside a container's
    /// namespace the path may not exist under the mount, whose root then is the process's
    /// own cgroup. The limit is the smallest on the way up, as the kernel enforces it.
    fn read(&self, mount: &Path, path: &str) -> Option<CgroupMemory> {
        let relative = path.trim_start_matches('/');
        let leaf = [mount.join(relative), mount.to_path_buf()]
            .into_iter()
            .find(|dir| dir.join(self.usage).is_file())?;
        let mut limit = u64::MAX;
        let mut dir: Option<PathBuf> = Some(leaf.clone());
        while let Some(d) = dir {
            if let Some(l) = read_limit(&d.join(self.limit)) {
                limit = limit.min(l);
            }
            if d == mount {
                break;
            }
            dir = d.parent().map(Path::to_path_buf);
        }
        if limit >= UNLIMITED {
            return None;
        }
        let usage = read_u64(&leaf.join(self.usage))?;
        let inactive = std::fs::read_to_string(leaf.join("memory.stat"))
            .ok()
            .and_then(|stat| {
                stat.lines().find_map(|l| {
                    let (key, value) = l.split_once(' ')?;
                    (key == self.inactive).then(|| value.trim().parse().ok())?
                })
            })
            .unwrap_or(0);
        Some(CgroupMemory {
            limit,
            working_set: usage.saturating_sub(inactive),
        })
    }
}

/// A limit file: a byte count, or `max` (none).
fn read_limit(path: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    match text.trim() {
        "max" => Some(u64::MAX),
        n => n.parse().ok(),
    }
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(root: &Path, rel: &str, text: &str) {
        let path = root.join(rel);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(path, text).expect("write");
    }

    #[test]
    fn v2_limit_usage_and_inactive_cache() {
        let root = tempfile::tempdir().expect("tempdir");
        let r = root.path();
        write(r, "kubepods/pod1/memory.max", "8589934592\n");
        write(r, "kubepods/pod1/ctr/memory.max", "max\n");
        write(r, "kubepods/pod1/ctr/memory.current", "3221225472\n");
        write(
            r,
            "kubepods/pod1/ctr/memory.stat",
            "anon 1073741824\ninactive_file 1073741824\nactive_file 5\n",
        );
        let found = cgroup_memory("0::/kubepods/pod1/ctr\n", r).expect("a limit");
        // The parent's 8 GiB binds; 3 GiB used of which 1 GiB is reclaimable cache.
        assert_eq!(found.limit, 8 << 30);
        assert_eq!(found.working_set, 2 << 30);
        assert_eq!(found.headroom(), 6 << 30);
        let host = HostMemory {
            available: Some(100 << 30),
            cgroup: Some(found),
        };
        assert_eq!(host.usable(), Some(6 << 30));
        assert!(
            host.describe().contains("cgroup limit 8.0 GiB"),
            "{}",
            host.describe()
        );
    }

    #[test]
    fn v2_inside_a_namespace_and_unlimited() {
        let root = tempfile::tempdir().expect("tempdir");
        let r = root.path();
        // The container sees its own cgroup as the mount's root.
        write(r, "memory.max", "1073741824");
        write(r, "memory.current", "536870912");
        let found = cgroup_memory("0::/\n", r).expect("a limit");
        assert_eq!((found.limit, found.working_set), (1 << 30, 1 << 29));
        write(r, "memory.max", "max");
        assert_eq!(cgroup_memory("0::/\n", r), None);
    }

    #[test]
    fn v1_memory_controller() {
        let root = tempfile::tempdir().expect("tempdir");
        let r = root.path();
        write(r, "memory/docker/abc/memory.limit_in_bytes", "2147483648\n");
        write(r, "memory/docker/abc/memory.usage_in_bytes", "1073741824\n");
        write(
            r,
            "memory/docker/abc/memory.stat",
            "cache 5\ntotal_inactive_file 536870912\n",
        );
        let proc = "12:pids:/docker/abc\n4:memory:/docker/abc\n0::/docker/abc\n";
        let found = cgroup_memory(proc, r).expect("a limit");
        assert_eq!(found.limit, 2 << 30);
        assert_eq!(found.working_set, 1 << 29);
        // No limit: v1 writes a page-rounded i64::MAX.
        write(
            r,
            "memory/docker/abc/memory.limit_in_bytes",
            "9223372036854771712",
        );
        assert_eq!(cgroup_memory(proc, r), None);
        // A machine without cgroup files.
        assert_eq!(cgroup_memory(proc, &r.join("nothing")), None);
    }

    #[test]
    fn this_machine_reads_without_failing() {
        let host = HostMemory::read();
        assert!(!host.describe().is_empty());
    }
}
