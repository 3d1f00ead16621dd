//! Running programs for tools: an allowlist of programs, and each run confined.
//!
//! ```text
//! Sandbox::run(program, args, workdir)
//!   fork ─► child: rlimits (CPU, address space, file size, open files, no core dumps)
//!         │        landlock: read-only system paths, read-write workdir, execute only the
//!         │                  allowlisted programs (and their ELF/#! interpreters),
//!         │                  no TCP bind/connect, no signals or abstract sockets outside
//!         │        seccomp: no AF_INET/AF_INET6/AF_PACKET sockets, no io_uring, ptrace,
//!         │                 bpf, mount, namespaces, kernel modules
//!         │        execve(program) with a clean environment, its own process group
//!   parent ─► stdout/stderr read concurrently, each kept to a head and a tail
//!          ─► wall-clock deadline: the whole process group is killed
//! ```
//!
//! Landlock and seccomp come from the `landlock` and `seccompiler` crates, the rlimits
//! from `nix`. On a kernel without Landlock the filesystem and TCP rules cannot be
//! enforced: [`Sandbox::status`] says so and the agent logs it at start; seccomp, the
//! rlimits, the clean environment and the time and output limits still apply.

#[cfg(target_os = "linux")]
mod linux;

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;

use crate::config::{SandboxConfig, SandboxOverrides};

/// Where program names in the allowlist are looked up (never the agent's own `PATH`).
pub const SANDBOX_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// What programs may read when `read_paths` is not set.
const DEFAULT_READ_PATHS: &[&str] = &[
    "/usr",
    "/lib",
    "/lib32",
    "/lib64",
    "/bin",
    "/sbin",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/localtime",
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/hosts",
    "/etc/resolv.conf",
    "/etc/ssl/certs",
    "/etc/ca-certificates",
    "/etc/mime.types",
    "/etc/python3",
];

/// The programs of `[sandbox] programs`, resolved to files.
#[derive(Debug, Clone, Default)]
pub struct Allowlist {
    /// Name as written → the file it resolved to.
    programs: BTreeMap<String, PathBuf>,
    /// Every file execve may open: the programs and their interpreters.
    exec_files: Vec<PathBuf>,
}

impl Allowlist {
    /// Resolves each entry (a name in [`SANDBOX_PATH`] or an absolute path) and the
    /// interpreters it needs.
    ///
    /// # Errors
    ///
    /// The entry that is not found or is not a regular file.
    pub fn new(programs: &[String]) -> Result<Allowlist, String> {
        let mut list = Allowlist::default();
        for name in programs {
            let path = find_program(name)?;
            let canonical = std::fs::canonicalize(&path)
                .map_err(|e| format!("program `{name}` ({}): {e}", path.display()))?;
            for file in exec_closure(&canonical) {
                if !list.exec_files.contains(&file) {
                    list.exec_files.push(file);
                }
            }
            list.programs.insert(name.clone(), canonical);
        }
        Ok(list)
    }

    /// The file `program` (a name or path from a tool's definition) runs, if it is allowed.
    pub fn resolve(&self, program: &str) -> Option<&Path> {
        if let Some(path) = self.programs.get(program) {
            return Some(path);
        }
        let wanted = if program.contains('/') {
            std::fs::canonicalize(program).ok()?
        } else {
            std::fs::canonicalize(find_program(program).ok()?).ok()?
        };
        self.programs
            .values()
            .find(|p| **p == wanted)
            .map(PathBuf::as_path)
    }

    /// The allowed names, for messages.
    pub fn names(&self) -> Vec<&str> {
        self.programs.keys().map(String::as_str).collect()
    }
}

/// `name` as a file: an absolute path as is, else the first match in [`SANDBOX_PATH`].
fn find_program(name: &str) -> Result<PathBuf, String> {
    if name.is_empty() {
        return Err("an empty program name".into());
    }
    if name.contains('/') {
        let path = PathBuf::from(name);
        if !path.is_absolute() {
            return Err(format!(
                "program `{name}`: give a name or an absolute path, not a relative path"
            ));
        }
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!("program `{name}` is not a file"))
        };
    }
    SANDBOX_PATH
        .split(':')
        .map(|dir| Path::new(dir).join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| format!("program `{name}` is not found in {SANDBOX_PATH}"))
}

/// `file` and the interpreters the kernel opens to execute it: a `#!` script's
/// interpreter and an ELF file's `PT_INTERP` (the dynamic loader), recursively.
fn exec_closure(file: &Path) -> Vec<PathBuf> {
    let mut out = vec![file.to_owned()];
    let mut i = 0;
    while i < out.len() && out.len() < 8 {
        if let Some(interp) = interpreter_of(&out[i]) {
            if let Ok(canonical) = std::fs::canonicalize(&interp) {
                if !out.contains(&canonical) {
                    out.push(canonical);
                }
            }
        }
        i += 1;
    }
    out
}

/// The interpreter named by a `#!` line or an ELF `PT_INTERP` header.
fn interpreter_of(file: &Path) -> Option<PathBuf> {
    let bytes = read_prefix(file, 4096)?;
    if let Some(line) = bytes.strip_prefix(b"#!") {
        let line = line.split(|&b| b == b'\n').next()?;
        let text = std::str::from_utf8(line).ok()?.trim();
        let interp = text.split_whitespace().next()?;
        return Some(PathBuf::from(interp));
    }
    elf_interpreter(&bytes)
}

fn read_prefix(file: &Path, n: usize) -> Option<Vec<u8>> {
    use std::io::Read;
    let mut f = std::fs::File::open(file).ok()?;
    let mut buf = vec![0u8; n];
    let mut len = 0;
    while len < n {
        match f.read(&mut buf[len..]) {
            Ok(0) => break,
            Ok(k) => len += k,
            Err(_) => return None,
        }
    }
    buf.truncate(len);
    Some(buf)
}

/// `PT_INTERP` of a 64-bit little-endian ELF file whose program headers lie in `bytes`.
fn elf_interpreter(bytes: &[u8]) -> Option<PathBuf> {
    const PT_INTERP: u32 = 3;
    if bytes.get(..4)? != b"\x7fELF" || *bytes.get(4)? != 2 || *bytes.get(5)? != 1 {
        return None;
    }
    let u16_at = |o: usize| Some(u16::from_le_bytes(bytes.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(bytes.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(bytes.get(o..o + 8)?.try_into().ok()?));
    let phoff = usize::try_from(u64_at(0x20)?).ok()?;
    let phentsize = usize::from(u16_at(0x36)?);
    let phnum = usize::from(u16_at(0x38)?);
    for i in 0..phnum {
        let ph = phoff.checked_add(i.checked_mul(phentsize)?)?;
        if u32_at(ph)? == PT_INTERP {
            let offset = usize::try_from(u64_at(ph + 8)?).ok()?;
            let size = usize::try_from(u64_at(ph + 32)?).ok()?;
            let raw = bytes.get(offset..offset.checked_add(size)?)?;
            let raw = raw.split(|&b| b == 0).next()?;
            return Some(PathBuf::from(std::str::from_utf8(raw).ok()?));
        }
    }
    None
}

/// The limits of one tool's runs.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Programs may open inet sockets.
    pub network: bool,
    /// Wall-clock limit.
    pub timeout: Duration,
    /// RLIMIT_CPU, seconds.
    pub cpu_seconds: u64,
    /// RLIMIT_AS, bytes.
    pub memory_bytes: u64,
    /// RLIMIT_FSIZE, bytes.
    pub file_bytes: u64,
    /// RLIMIT_NOFILE.
    pub open_files: u64,
    /// Bytes kept of each of stdout and stderr.
    pub max_output_bytes: usize,
}

impl Limits {
    /// `[sandbox]` with a tool's overrides.
    ///
    /// # Errors
    ///
    /// A limit that is zero, negative or not finite, named.
    pub fn new(base: &SandboxConfig, over: &SandboxOverrides) -> Result<Limits, String> {
        let timeout = over.timeout_seconds.unwrap_or(base.timeout_seconds);
        if !(timeout > 0.0 && timeout < 1e7) {
            return Err(format!("timeout_seconds must be positive, got {timeout}"));
        }
        let cpu_seconds = over.cpu_seconds.unwrap_or(base.cpu_seconds);
        let memory_mb = over.memory_mb.unwrap_or(base.memory_mb);
        let max_output_bytes = over.max_output_bytes.unwrap_or(base.max_output_bytes);
        for (name, value) in [
            ("cpu_seconds", cpu_seconds),
            ("memory_mb", memory_mb),
            ("max_file_mb", base.max_file_mb),
            ("max_open_files", base.max_open_files),
            ("max_output_bytes", max_output_bytes as u64),
        ] {
            if value == 0 {
                return Err(format!("{name} must be at least 1"));
            }
        }
        Ok(Limits {
            network: over.network.unwrap_or(base.network),
            timeout: Duration::from_secs_f64(timeout),
            cpu_seconds,
            memory_bytes: memory_mb.saturating_mul(1 << 20),
            file_bytes: base.max_file_mb.saturating_mul(1 << 20),
            open_files: base.max_open_files,
            max_output_bytes,
        })
    }
}

/// Shared by every sandboxed tool of a registry: the allowlist, paths and environment.
#[derive(Debug)]
pub struct Sandbox {
    allowlist: Allowlist,
    read_paths: Vec<PathBuf>,
    write_paths: Vec<PathBuf>,
    env: Vec<(String, String)>,
    /// The shared working directory (`[sandbox] workdir`), if set.
    pub workdir: Option<PathBuf>,
}

impl Sandbox {
    /// From `[sandbox]` (paths already relative to the tools file's directory).
    ///
    /// # Errors
    ///
    /// A program that cannot be found, an environment variable that is not set, or a
    /// working directory that cannot be created.
    pub fn new(config: &SandboxConfig, base_dir: &Path) -> Result<Sandbox, String> {
        let allowlist = Allowlist::new(&config.programs)?;
        let read_paths = match &config.read_paths {
            Some(paths) => paths
                .iter()
                .map(|p| crate::config::resolve(base_dir, p))
                .collect(),
            None => DEFAULT_READ_PATHS.iter().map(PathBuf::from).collect(),
        };
        let write_paths = config
            .write_paths
            .iter()
            .map(|p| crate::config::resolve(base_dir, p))
            .collect();
        let mut env = vec![
            ("PATH".to_string(), SANDBOX_PATH.to_string()),
            ("LANG".to_string(), "C.UTF-8".to_string()),
        ];
        for (name, value) in &config.env {
            let value =
                crate::config::expand_env(value).map_err(|e| format!("env `{name}`: {e}"))?;
            env.retain(|(n, _)| n != name);
            env.push((name.clone(), value));
        }
        let workdir = match &config.workdir {
            Some(dir) => {
                let dir = crate::config::resolve(base_dir, dir);
                std::fs::create_dir_all(&dir)
                    .map_err(|e| format!("workdir {}: {e}", dir.display()))?;
                Some(
                    std::fs::canonicalize(&dir)
                        .map_err(|e| format!("workdir {}: {e}", dir.display()))?,
                )
            }
            None => None,
        };
        Ok(Sandbox {
            allowlist,
            read_paths,
            write_paths,
            env,
            workdir,
        })
    }

    /// No programs allowed, default paths.
    pub fn empty() -> Sandbox {
        Sandbox {
            allowlist: Allowlist::default(),
            read_paths: DEFAULT_READ_PATHS.iter().map(PathBuf::from).collect(),
            write_paths: Vec::new(),
            env: vec![("PATH".to_string(), SANDBOX_PATH.to_string())],
            workdir: None,
        }
    }

    /// The allowlisted programs.
    pub fn allowlist(&self) -> &Allowlist {
        &self.allowlist
    }

    /// What this kernel enforces, in words, for the start-up log.
    pub fn status() -> String {
        #[cfg(target_os = "linux")]
        {
            linux::status()
        }
        #[cfg(not(target_os = "linux"))]
        {
            "no sandbox on this platform: sandboxed tools are refused".into()
        }
    }

    /// Whether Landlock's filesystem and execute rules are enforced on this kernel.
    pub fn landlock_enforced() -> bool {
        #[cfg(target_os = "linux")]
        {
            !matches!(
                linux::landlock_status(),
                &landlock::RulesetStatus::NotEnforced
            )
        }
        #[cfg(not(target_os = "linux"))]
        {
            false
        }
    }

    /// Runs `program` (an allowlisted file) with `args` in `workdir` under `limits`, its
    /// standard input /dev/null.
    pub async fn run(
        &self,
        program: &Path,
        args: &[String],
        workdir: &Path,
        limits: &Limits,
    ) -> RunOutcome {
        let start = Instant::now();
        let mut command = tokio::process::Command::new(program);
        command
            .args(args)
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("HOME", workdir)
            .env("TMPDIR", workdir)
            .current_dir(workdir)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        #[cfg(unix)]
        command.process_group(0);
        #[cfg(target_os = "linux")]
        if let Err(e) = linux::confine(&mut command, self, workdir, limits) {
            return RunOutcome::failed(format!("the sandbox could not be set up: {e}"), start);
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = &mut command;
            return RunOutcome::failed("sandboxed programs need Linux".into(), start);
        }
        #[allow(unreachable_code)]
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                return RunOutcome::failed(
                    format!("cannot start {}: {e}", program.display()),
                    start,
                )
            }
        };
        let cap = limits.max_output_bytes;
        let stdout = Arc::new(Mutex::new(Capture::new(cap)));
        let stderr = Arc::new(Mutex::new(Capture::new(cap)));
        let mut readers = tokio::task::JoinSet::new();
        if let Some(pipe) = child.stdout.take() {
            readers.spawn(drain(pipe, Arc::clone(&stdout)));
        }
        if let Some(pipe) = child.stderr.take() {
            readers.spawn(drain(pipe, Arc::clone(&stderr)));
        }
        let deadline = tokio::time::Instant::from_std(start) + limits.timeout;
        let pid = child.id();
        let exit = match tokio::time::timeout_at(deadline, child.wait()).await {
            Ok(Ok(status)) => {
                // Anything the program left running in its group goes too (the group
                // outlives the leader only while members remain, so its id is not reused).
                kill_group(pid);
                Exit::Status(status)
            }
            Ok(Err(e)) => {
                kill_group(pid);
                return RunOutcome::failed(format!("waiting for the program failed: {e}"), start);
            }
            Err(_) => {
                // Not reaped yet: the group id cannot have been reused.
                kill_group(pid);
                let _ = child.wait().await;
                Exit::TimedOut
            }
        };
        // The pipes close once every process of the group is gone; a process that left
        // the group could hold them open, so the readers get a short grace, then stop.
        let grace = tokio::time::Instant::now() + Duration::from_millis(500);
        while tokio::time::timeout_at(grace, readers.join_next())
            .await
            .is_ok_and(|r| r.is_some())
        {}
        readers.abort_all();
        let take = |c: &Arc<Mutex<Capture>>| {
            c.lock()
                .map(|mut c| std::mem::replace(&mut *c, Capture::new(0)))
                .unwrap_or_else(|_| Capture::new(0))
        };
        RunOutcome {
            exit,
            stdout: take(&stdout),
            stderr: take(&stderr),
            elapsed: start.elapsed(),
            error: None,
        }
    }
}

fn kill_group(pid: Option<u32>) {
    #[cfg(target_os = "linux")]
    if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    #[cfg(not(target_os = "linux"))]
    let _ = pid;
}

async fn drain(mut pipe: impl tokio::io::AsyncRead + Unpin, into: Arc<Mutex<Capture>>) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if let Ok(mut c) = into.lock() {
                    c.push(&buf[..n]);
                }
            }
        }
    }
}

/// How a run ended.
#[derive(Debug)]
pub enum Exit {
    /// The program exited or was killed by a signal.
    Status(std::process::ExitStatus),
    /// It ran past the wall-clock limit and was killed.
    TimedOut,
    /// It could not be started.
    NotStarted,
}

/// A finished run.
#[derive(Debug)]
pub struct RunOutcome {
    /// How it ended.
    pub exit: Exit,
    /// Standard output (head and tail).
    pub stdout: Capture,
    /// Standard error (head and tail).
    pub stderr: Capture,
    /// Wall-clock time.
    pub elapsed: Duration,
    /// Why it could not start.
    pub error: Option<String>,
}

impl RunOutcome {
    fn failed(message: String, start: Instant) -> RunOutcome {
        RunOutcome {
            exit: Exit::NotStarted,
            stdout: Capture::new(0),
            stderr: Capture::new(0),
            elapsed: start.elapsed(),
            error: Some(message),
        }
    }

    /// Whether the program exited with status 0.
    pub fn success(&self) -> bool {
        matches!(&self.exit, Exit::Status(s) if s.success())
    }

    /// The run as text for the model: the output, and when it failed, how.
    pub fn describe(&self, limits: &Limits) -> String {
        let mut out = String::new();
        let (stdout, stdout_note) = self.stdout.text();
        let (stderr, stderr_note) = self.stderr.text();
        match &self.exit {
            Exit::NotStarted => {
                return format!(
                    "error: {}",
                    self.error.as_deref().unwrap_or("the program did not start")
                )
            }
            Exit::TimedOut => out.push_str(&format!(
                "error: the program ran past its time limit of {} s and was killed\n",
                limits.timeout.as_secs_f64()
            )),
            Exit::Status(status) => {
                if let Some(code) = status.code() {
                    if code != 0 {
                        out.push_str(&format!("error: the program exited with status {code}\n"));
                    }
                } else if let Some(signal) = signal_of(status) {
                    out.push_str(&format!(
                        "error: the program was killed by {}\n",
                        describe_signal(signal, limits)
                    ));
                }
            }
        }
        if self.success() && stderr.is_empty() && stdout_note.is_none() {
            if stdout.is_empty() {
                return "(the program succeeded and printed nothing)".into();
            }
            return stdout;
        }
        out.push_str("stdout:\n");
        out.push_str(&stdout);
        if let Some(note) = stdout_note {
            out.push_str(&format!("\n[{note}]"));
        }
        if !stderr.is_empty() || stderr_note.is_some() {
            out.push_str("\nstderr:\n");
            out.push_str(&stderr);
            if let Some(note) = stderr_note {
                out.push_str(&format!("\n[{note}]"));
            }
        }
        out
    }
}

#[cfg(unix)]
fn signal_of(status: &std::process::ExitStatus) -> Option<i32> {
    use std::os::unix::process::ExitStatusExt;
    status.signal()
}

#[cfg(not(unix))]
fn signal_of(_: &std::process::ExitStatus) -> Option<i32> {
    None
}

fn describe_signal(signal: i32, limits: &Limits) -> String {
    match signal {
        libc::SIGXCPU => format!(
            "SIGXCPU: it used its CPU time limit of {} s",
            limits.cpu_seconds
        ),
        libc::SIGXFSZ => format!(
            "SIGXFSZ: it wrote a file larger than the limit of {} MiB",
            limits.file_bytes >> 20
        ),
        libc::SIGKILL => "SIGKILL (the CPU time limit's hard stop, or the system)".into(),
        libc::SIGSEGV => "SIGSEGV (a crash; also what some programs do when they run out of \
                          memory under the address-space limit)"
            .into(),
        libc::SIGABRT => "SIGABRT (it aborted, e.g. when an allocation failed under the \
                          memory limit)"
            .into(),
        libc::SIGSYS => "SIGSYS (a system call the sandbox forbids)".into(),
        other => format!("signal {other}"),
    }
}

/// A stream's output: its first bytes, its last bytes, and how much there was.
#[derive(Debug)]
pub struct Capture {
    head: Vec<u8>,
    tail: VecDeque<u8>,
    head_cap: usize,
    tail_cap: usize,
    total: u64,
}

impl Capture {
    /// Keeps up to `cap` bytes: all of a short output, else the first and last halves.
    pub fn new(cap: usize) -> Capture {
        let head_cap = cap / 2 + cap % 2;
        Capture {
            head: Vec::new(),
            tail: VecDeque::new(),
            head_cap,
            tail_cap: cap - head_cap,
            total: 0,
        }
    }

    /// Appends `bytes`.
    pub fn push(&mut self, mut bytes: &[u8]) {
        self.total += bytes.len() as u64;
        let room = self.head_cap.saturating_sub(self.head.len());
        let n = room.min(bytes.len());
        self.head.extend_from_slice(&bytes[..n]);
        bytes = &bytes[n..];
        if bytes.len() >= self.tail_cap {
            self.tail.clear();
            self.tail.extend(&bytes[bytes.len() - self.tail_cap..]);
        } else {
            let excess = (self.tail.len() + bytes.len()).saturating_sub(self.tail_cap);
            self.tail.drain(..excess);
            self.tail.extend(bytes);
        }
    }

    /// Bytes the stream carried in all.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The output as text, and a note when bytes were elided or were not UTF-8.
    pub fn text(&self) -> (String, Option<String>) {
        let kept = (self.head.len() + self.tail.len()) as u64;
        let tail: Vec<u8> = self.tail.iter().copied().collect();
        if kept == self.total {
            let mut all = self.head.clone();
            all.extend_from_slice(&tail);
            return match String::from_utf8(all) {
                Ok(s) => (s, None),
                Err(e) => (
                    String::from_utf8_lossy(e.as_bytes()).into_owned(),
                    Some(INVALID_UTF8.into()),
                ),
            };
        }
        // Cut at character boundaries so that the cut itself is not reported as bad UTF-8.
        let head = trim_partial_end(&self.head);
        let tail = trim_partial_start(&tail);
        let (head_text, head_bad) = lossy(head);
        let (tail_text, tail_bad) = lossy(tail);
        let elided = self.total - kept;
        let mut note = format!(
            "{} bytes in all; the {elided} bytes in the middle were not kept",
            self.total
        );
        if head_bad || tail_bad {
            note.push_str("; ");
            note.push_str(INVALID_UTF8);
        }
        (
            format!("{head_text}\n[... {elided} bytes elided ...]\n{tail_text}"),
            Some(note),
        )
    }
}

const INVALID_UTF8: &str =
    "the output was not valid UTF-8: invalid bytes are shown as U+FFFD (\u{FFFD})";

fn lossy(bytes: &[u8]) -> (String, bool) {
    match std::str::from_utf8(bytes) {
        Ok(s) => (s.to_owned(), false),
        Err(_) => (String::from_utf8_lossy(bytes).into_owned(), true),
    }
}

/// `bytes` without a multi-byte character cut off at its end.
pub(crate) fn trim_partial_end(bytes: &[u8]) -> &[u8] {
    match std::str::from_utf8(bytes) {
        Err(e) if e.error_len().is_none() => &bytes[..e.valid_up_to()],
        _ => bytes,
    }
}

/// `bytes` without the continuation bytes of a character cut off at its start.
pub(crate) fn trim_partial_start(bytes: &[u8]) -> &[u8] {
    let skip = bytes
        .iter()
        .take(3)
        .take_while(|&&b| b & 0xC0 == 0x80)
        .count();
    &bytes[skip..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capture_keeps_head_and_tail() {
        let mut c = Capture::new(10);
        c.push(b"0123");
        c.push(b"456789abcdef");
        c.push(b"XYZ");
        assert_eq!(c.total(), 19);
        let (text, note) = c.text();
        assert!(
            text.starts_with("01234\n[... 9 bytes elided ...]\n"),
            "{text}"
        );
        assert!(text.ends_with("efXYZ"), "{text}");
        assert!(note.unwrap().contains("19 bytes"));
        let mut short = Capture::new(10);
        short.push(b"hi");
        assert_eq!(short.text(), ("hi".to_string(), None));
    }

    #[test]
    fn invalid_utf8_is_said() {
        let mut c = Capture::new(100);
        c.push(b"ok \xff\xfe end");
        let (text, note) = c.text();
        assert!(text.contains('\u{FFFD}'));
        assert!(note.unwrap().contains("UTF-8"));
        // A cut inside a character is not reported as invalid.
        let mut c = Capture::new(6);
        c.push("ééééééééé".as_bytes());
        let (_, note) = c.text();
        assert!(!note.unwrap().contains("UTF-8"));
    }

    #[test]
    fn interpreters_are_found() {
        let sh = std::fs::canonicalize("/bin/sh").unwrap();
        let closure = exec_closure(&sh);
        assert_eq!(closure[0], sh);
        // A dynamically linked /bin/sh names its loader.
        if closure.len() > 1 {
            assert!(closure[1].to_string_lossy().contains("ld"), "{closure:?}");
        }
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("s");
        std::fs::write(&script, "#!/bin/sh -e\necho\n").unwrap();
        assert_eq!(interpreter_of(&script), Some(PathBuf::from("/bin/sh")));
    }

    #[test]
    fn allowlist_resolves_names_only_in_the_sandbox_path() {
        let list = Allowlist::new(&["ls".into()]).unwrap();
        assert!(list.resolve("ls").is_some());
        assert!(list.resolve("/bin/ls").is_some() || list.resolve("/usr/bin/ls").is_some());
        assert!(list.resolve("cat").is_none());
        assert!(Allowlist::new(&["no-such-program-xyz".into()])
            .unwrap_err()
            .contains("no-such-program-xyz"));
        assert!(Allowlist::new(&["./ls".into()]).is_err());
    }
}
