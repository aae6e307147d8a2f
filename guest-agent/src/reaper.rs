//! The one place that reaps child processes.
//!
//! As PID 1 the agent inherits every orphan in the guest and must reap them, but a blanket
//! `wait(-1)` would also steal the exit status of the processes that executions wait for. So a
//! single reaper thread does all reaping: on every SIGCHLD it reaps whatever exited and hands the
//! status of a registered child to its [`ExitSlot`] (waking the execution), and drops the rest.
//!
//! Spawning holds the read side of a lock that the reaper takes for writing while it reaps.
//! That closes two races: a child that exits before its pid is registered is reaped only after
//! the registration, and std's `Command::spawn`, which itself waits for a child whose `exec`
//! failed, never finds that child already reaped.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use crate::sys::{self, Reaped};

/// A non-blocking eventfd that wakes a `poll` loop from another thread.
#[derive(Debug)]
pub struct Waker {
    fd: File,
}

impl Waker {
    pub fn new() -> io::Result<Self> {
        Ok(Self {
            fd: File::from(sys::eventfd()?),
        })
    }

    /// Makes the descriptor readable until [`drain`](Self::drain).
    pub fn wake(&self) {
        // Cannot block (non-blocking) and cannot usefully fail: a saturated counter still wakes.
        let _ = (&self.fd).write(&1u64.to_ne_bytes());
    }

    /// Clears the wake-up.
    pub fn drain(&self) {
        let mut buf = [0u8; 8];
        let _ = (&self.fd).read(&mut buf);
    }
}

/// Where the reaper puts the exit of one child.
#[derive(Debug)]
pub struct ExitSlot {
    exit: Mutex<Option<(Reaped, Instant)>>,
    waker: Arc<Waker>,
}

impl ExitSlot {
    pub fn new(waker: Arc<Waker>) -> Self {
        Self {
            exit: Mutex::new(None),
            waker,
        }
    }

    /// The exit, once the child was reaped, with the time it was reaped.
    pub fn take(&self) -> Option<(Reaped, Instant)> {
        self.exit
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    fn deliver(&self, reaped: Reaped) {
        *self.exit.lock().unwrap_or_else(PoisonError::into_inner) = Some((reaped, Instant::now()));
        self.waker.wake();
    }
}

/// The reaper: see the module documentation.
#[derive(Debug, Default)]
pub struct Reaper {
    spawn_lock: RwLock<()>,
    waiting: Mutex<HashMap<i32, Arc<ExitSlot>>>,
}

impl Reaper {
    /// Starts the reaper thread. SIGCHLD must already be blocked in every thread
    /// ([`sys::block_sigchld`] before any thread starts).
    pub fn start() -> io::Result<Arc<Self>> {
        let reaper = Arc::new(Self::default());
        let me = Arc::clone(&reaper);
        std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || me.run())?;
        Ok(reaper)
    }

    /// Spawns `cmd`; its exit will be delivered to `slot`.
    pub fn spawn(&self, cmd: &mut Command, slot: Arc<ExitSlot>) -> io::Result<Child> {
        let _no_reaping = self
            .spawn_lock
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        let child = cmd.spawn()?;
        let pid = i32::try_from(child.id()).unwrap_or(i32::MAX);
        self.waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(pid, slot);
        Ok(child)
    }

    fn run(&self) {
        loop {
            self.reap_all();
            if let Err(e) = sys::wait_sigchld() {
                eprintln!("airlock-agent: waiting for SIGCHLD: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// Reaps every exited child; delivers registered ones, drops orphans.
    fn reap_all(&self) {
        let _reaping = self
            .spawn_lock
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        loop {
            match sys::reap_any() {
                Ok(Some(reaped)) => self.dispatch(reaped),
                Ok(None) => return,
                Err(e) => {
                    eprintln!("airlock-agent: reaping: {e}");
                    return;
                }
            }
        }
    }

    fn dispatch(&self, reaped: Reaped) {
        let slot = self
            .waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&reaped.pid);
        if let Some(slot) = slot {
            slot.deliver(reaped);
        }
    }
}

impl AsRawFd for Waker {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reaped(pid: i32) -> Reaped {
        Reaped {
            pid,
            status: 0,
            rusage: sys::Rusage::default(),
        }
    }

    #[test]
    fn dispatch_delivers_registered_pid_and_wakes() {
        let reaper = Reaper::default();
        let waker = Arc::new(Waker::new().unwrap());
        let slot = Arc::new(ExitSlot::new(Arc::clone(&waker)));
        reaper.waiting.lock().unwrap().insert(42, Arc::clone(&slot));
        reaper.dispatch(reaped(42));
        let (got, _) = slot.take().unwrap();
        assert_eq!(got.pid, 42);
        let mut fds = [libc::pollfd {
            fd: waker.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        assert_eq!(sys::poll(&mut fds, Some(Duration::ZERO)).unwrap(), 1);
        assert!(reaper.waiting.lock().unwrap().is_empty());
    }

    #[test]
    fn dispatch_drops_unknown_pid() {
        let reaper = Reaper::default();
        let slot = Arc::new(ExitSlot::new(Arc::new(Waker::new().unwrap())));
        reaper.waiting.lock().unwrap().insert(1, Arc::clone(&slot));
        reaper.dispatch(reaped(2));
        assert!(slot.take().is_none());
        assert_eq!(reaper.waiting.lock().unwrap().len(), 1);
    }

    #[test]
    fn waker_drain_clears_readiness() {
        let waker = Waker::new().unwrap();
        waker.wake();
        waker.wake();
        waker.drain();
        let mut fds = [libc::pollfd {
            fd: waker.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        assert_eq!(sys::poll(&mut fds, Some(Duration::ZERO)).unwrap(), 0);
    }
}
