//! The Linux confinement of a sandboxed program: rlimits, a Landlock ruleset and a seccomp
//! filter, prepared in the parent and applied between fork and exec.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use landlock::{
    path_beneath_rules, Access, AccessFs, AccessNet, CompatLevel, Compatible, Ruleset, RulesetAttr,
    RulesetCreated, RulesetCreatedAttr, RulesetStatus, Scope, ABI,
};
use nix::sys::resource::{setrlimit, Resource};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use super::{Limits, Sandbox};

/// The newest Landlock ABI this code knows; older kernels get what they support.
const ABI_WANTED: ABI = ABI::V6;

/// Adds the confinement to `command` (see the module docs of `sandbox`).
#[allow(unsafe_code)]
pub(super) fn confine(
    command: &mut tokio::process::Command,
    sandbox: &Sandbox,
    workdir: &Path,
    limits: &Limits,
) -> Result<(), String> {
    let mut ruleset = Some(ruleset(sandbox, workdir, limits.network)?);
    let filter = seccomp_filter(limits.network)?;
    let rlimits = [
        (
            Resource::RLIMIT_CPU,
            limits.cpu_seconds,
            limits.cpu_seconds + 1,
        ),
        (
            Resource::RLIMIT_AS,
            limits.memory_bytes,
            limits.memory_bytes,
        ),
        (Resource::RLIMIT_FSIZE, limits.file_bytes, limits.file_bytes),
        (
            Resource::RLIMIT_NOFILE,
            limits.open_files,
            limits.open_files,
        ),
        (Resource::RLIMIT_CORE, 0, 0),
    ];
    let child_setup = move || -> std::io::Result<()> {
        for (resource, soft, hard) in rlimits {
            setrlimit(resource, soft, hard)
                .map_err(|errno| std::io::Error::from_raw_os_error(errno as i32))?;
        }
        if let Some(ruleset) = ruleset.take() {
            // On failure errno still holds the failed call's error.
            ruleset
                .restrict_self()
                .map_err(|_| std::io::Error::last_os_error())?;
        }
        seccompiler::apply_filter(&filter).map_err(|_| std::io::Error::last_os_error())?;
        Ok(())
    };
    // SAFETY: the closure runs in the forked child before exec. It only makes system
    // calls (setrlimit, prctl, landlock_restrict_self, seccomp, close) on values prepared
    // in the parent: it allocates nothing and takes no lock, so it cannot deadlock on a
    // lock another parent thread held at fork time.
    unsafe {
        command.pre_exec(child_setup);
    }
    Ok(())
}

/// The Landlock rules: read-only system paths, read-write working directory and
/// `write_paths`, execution of the allowlisted files only, and (without network) no TCP.
fn ruleset(sandbox: &Sandbox, workdir: &Path, network: bool) -> Result<RulesetCreated, String> {
    let abi = ABI_WANTED;
    let err = |e: landlock::RulesetError| format!("landlock: {e}");
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(AccessFs::from_all(abi))
        .map_err(err)?
        .scope(Scope::from_all(abi))
        .map_err(err)?;
    if !network {
        ruleset = ruleset
            .handle_access(AccessNet::BindTcp | AccessNet::ConnectTcp)
            .map_err(err)?;
    }
    let read = AccessFs::ReadFile | AccessFs::ReadDir;
    // Everything but execution: a file the program writes cannot then be run.
    let write = AccessFs::from_all(abi) & !AccessFs::Execute;
    let devices_rw = ["/dev/null", "/dev/zero", "/dev/full"];
    let devices_ro = ["/dev/urandom", "/dev/random"];
    let mut writable: Vec<PathBuf> = vec![workdir.to_owned()];
    writable.extend(sandbox.write_paths.iter().cloned());
    ruleset
        .create()
        .map_err(err)?
        .add_rules(path_beneath_rules(&sandbox.read_paths, read))
        .map_err(err)?
        .add_rules(path_beneath_rules(devices_ro, AccessFs::ReadFile))
        .map_err(err)?
        .add_rules(path_beneath_rules(
            devices_rw,
            AccessFs::ReadFile | AccessFs::WriteFile,
        ))
        .map_err(err)?
        .add_rules(path_beneath_rules(&writable, write))
        .map_err(err)?
        .add_rules(path_beneath_rules(
            &sandbox.allowlist.exec_files,
            AccessFs::Execute | AccessFs::ReadFile,
        ))
        .map_err(err)
}

/// Syscalls no tool needs and that would undo the sandbox or reach past it.
fn forbidden_syscalls() -> Vec<i64> {
    vec![
        libc::SYS_io_uring_setup,
        libc::SYS_io_uring_enter,
        libc::SYS_io_uring_register,
        libc::SYS_ptrace,
        libc::SYS_process_vm_readv,
        libc::SYS_process_vm_writev,
        libc::SYS_bpf,
        libc::SYS_perf_event_open,
        libc::SYS_mount,
        libc::SYS_umount2,
        libc::SYS_pivot_root,
        libc::SYS_chroot,
        libc::SYS_unshare,
        libc::SYS_setns,
        libc::SYS_init_module,
        libc::SYS_finit_module,
        libc::SYS_delete_module,
        libc::SYS_kexec_load,
        libc::SYS_keyctl,
        libc::SYS_add_key,
        libc::SYS_request_key,
        libc::SYS_swapon,
        libc::SYS_swapoff,
        libc::SYS_reboot,
        libc::SYS_userfaultfd,
    ]
}

/// The seccomp program, built once per network setting: forbidden calls and, without
/// network, `socket(AF_INET | AF_INET6 | AF_PACKET, ...)` fail with EACCES.
fn seccomp_filter(network: bool) -> Result<Arc<BpfProgram>, String> {
    static WITH_NET: OnceLock<Result<Arc<BpfProgram>, String>> = OnceLock::new();
    static WITHOUT_NET: OnceLock<Result<Arc<BpfProgram>, String>> = OnceLock::new();
    let cell = if network { &WITH_NET } else { &WITHOUT_NET };
    cell.get_or_init(|| build_filter(network)).clone()
}

fn build_filter(network: bool) -> Result<Arc<BpfProgram>, String> {
    fn err(e: impl std::fmt::Display) -> String {
        format!("seccomp: {e}")
    }
    let arch = TargetArch::try_from(std::env::consts::ARCH).map_err(err)?;
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = forbidden_syscalls()
        .into_iter()
        .map(|nr| (nr, Vec::new()))
        .collect();
    if !network {
        let families = [libc::AF_INET, libc::AF_INET6, libc::AF_PACKET];
        let socket_rules = families
            .iter()
            .map(|&family| {
                let condition = SeccompCondition::new(
                    0,
                    SeccompCmpArgLen::Dword,
                    SeccompCmpOp::Eq,
                    family as u64,
                )?;
                SeccompRule::new(vec![condition])
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(err)?;
        rules.insert(libc::SYS_socket, socket_rules);
    }
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EACCES as u32),
        arch,
    )
    .map_err(err)?;
    let program = BpfProgram::try_from(filter).map_err(err)?;
    Ok(Arc::new(program))
}

/// What Landlock enforces on this kernel, found once by restricting a short-lived thread
/// with the same kind of ruleset.
pub(super) fn landlock_status() -> &'static RulesetStatus {
    static STATUS: OnceLock<RulesetStatus> = OnceLock::new();
    STATUS.get_or_init(|| {
        let probe = std::thread::spawn(|| {
            let abi = ABI_WANTED;
            Ruleset::default()
                .handle_access(AccessFs::from_all(abi))
                .and_then(|r| r.handle_access(AccessNet::BindTcp | AccessNet::ConnectTcp))
                .and_then(|r| r.scope(Scope::from_all(abi)))
                .and_then(|r| r.create())
                .and_then(|r| r.restrict_self())
                .map_or(RulesetStatus::NotEnforced, |s| s.ruleset)
        });
        probe.join().unwrap_or(RulesetStatus::NotEnforced)
    })
}

/// What this kernel enforces, in words.
pub(super) fn status() -> String {
    let landlock = match landlock_status() {
        RulesetStatus::FullyEnforced => {
            "landlock (filesystem, TCP, signal and abstract-socket scopes)"
        }
        RulesetStatus::PartiallyEnforced => {
            "landlock, partly (this kernel has an older Landlock ABI)"
        }
        RulesetStatus::NotEnforced => {
            "NO landlock on this kernel: filesystem access and the execute allowlist are not \
             enforced"
        }
    };
    format!(
        "{landlock}; seccomp (no inet sockets without network, no io_uring, ptrace, mount, \
         namespaces); rlimits (CPU, address space, file size, open files)"
    )
}
