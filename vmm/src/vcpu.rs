//! vCPU threads as an explicit state machine.
//!
//! Each vCPU runs on its own thread in one of three states:
//!
//! ```text
//!            Resume                    guest stops (fault, KVM error)
//!  Paused ─────────────▶ Running ──────────────────────────────▶ Exited
//!    ▲  ◀───────────────   │                                       │
//!    │       Pause         │ Finish                                │ Finish
//!    └─────────────────────┴──────────────▶ thread ends ◀─────────┘
//! ```
//!
//! The VMM thread sends [`VcpuEvent`]s over a channel and then *kicks* the vCPU with a signal
//! ([`crate::kick`]), whose handler sets `kvm_run.immediate_exit`, so a vCPU inside `KVM_RUN`
//! returns at once and a vCPU about to enter it does not block. Each event is answered with a
//! [`VcpuResponse`].

use std::error::Error as _;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::thread::JoinHandle;

use kvm_ioctls::{VcpuExit, VcpuFd};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::signal::Killable;

use crate::arch::pagewalk::read_virt;
use crate::devices::bus::Bus;
use crate::exit::VmExit;
use crate::snapshot::kvm::VcpuKvmState;

/// Commands from the VMM thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VcpuEvent {
    Resume,
    Pause,
    Finish,
    /// Report where the vCPU is (answered with [`VcpuResponse::State`]; the state is unchanged).
    ReportState,
    /// Read the vCPU's KVM state for a snapshot (answered with [`VcpuResponse::Saved`]); only
    /// while paused, else answered with an error.
    SaveState,
}

/// Answers to [`VcpuEvent`]s, and the unsolicited report that the guest stopped.
#[derive(Debug)]
pub enum VcpuResponse {
    /// Running (again), since this instant: the next thing the thread does is `KVM_RUN`.
    Resumed(std::time::Instant),
    Paused,
    /// The vCPU stopped for good; the VM should end with this reason.
    Exited(VmExit),
    /// Where the vCPU is: RIP and up to 16 instruction bytes there.
    State {
        rip: u64,
        insn: Vec<u8>,
    },
    /// The vCPU's KVM state, or why it could not be read.
    Saved(Result<Box<VcpuKvmState>, String>),
}

/// The state of a vCPU thread.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VcpuState {
    Paused,
    Running,
    Exited,
}

/// What one `KVM_RUN` returned, from the state machine's point of view.
enum RunOutcome {
    /// Exit handled; run again.
    Continue,
    /// Kicked or interrupted; look at the event channel.
    Interrupted,
    /// The guest cannot continue.
    Stop(VmExit),
}

/// One vCPU and what its exits need.
pub struct Vcpu {
    fd: VcpuFd,
    index: u8,
    pio: Arc<Bus>,
    mmio: Arc<Bus>,
    mem: GuestMemoryMmap,
    exit_evt: EventFd,
    /// The MSRs a snapshot saves (KVM's index list).
    msr_index_list: Arc<[u32]>,
}

impl std::fmt::Debug for Vcpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vcpu").field("index", &self.index).finish()
    }
}

/// The VMM thread's handle on a running vCPU thread.
#[derive(Debug)]
pub struct VcpuHandle {
    pub index: u8,
    events: Sender<VcpuEvent>,
    pub responses: Receiver<VcpuResponse>,
    thread: Option<JoinHandle<()>>,
}

impl VcpuHandle {
    /// Sends `event` and kicks the thread so that it sees it. `Resume` needs no kick: a paused
    /// thread waits on the channel, a running one has nothing to do.
    pub fn send(&self, event: VcpuEvent) {
        if self.events.send(event).is_err() {
            return; // the thread has ended already
        }
        if event == VcpuEvent::Resume {
            return;
        }
        if let Some(t) = &self.thread
            && let Err(e) = t.kill(crate::kick::signal())
        {
            log::debug!("kick vcpu{}: {e}", self.index);
        }
    }

    /// Ends the thread and waits for it.
    pub fn finish(&mut self) {
        self.send(VcpuEvent::Finish);
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            log::error!("vcpu{} thread panicked", self.index);
        }
    }
}

impl Drop for VcpuHandle {
    fn drop(&mut self) {
        self.finish();
    }
}

impl Vcpu {
    /// A vCPU whose exits go to `pio`/`mmio`; `exit_evt` is written when it stops for good.
    pub fn new(
        fd: VcpuFd,
        index: u8,
        pio: Arc<Bus>,
        mmio: Arc<Bus>,
        mem: GuestMemoryMmap,
        exit_evt: EventFd,
    ) -> Self {
        Self {
            fd,
            index,
            pio,
            mmio,
            mem,
            exit_evt,
            msr_index_list: Arc::from(Vec::new()),
        }
    }

    /// The MSRs [`VcpuEvent::SaveState`] saves (normally `Vm::msr_index_list`).
    pub fn set_msr_index_list(&mut self, list: &[u32]) {
        self.msr_index_list = Arc::from(list);
    }

    /// The vCPU fd, for configuration before the thread starts.
    pub fn fd(&self) -> &VcpuFd {
        &self.fd
    }

    /// Starts the thread in the `Paused` state.
    pub fn start_paused(self) -> std::io::Result<VcpuHandle> {
        let index = self.index;
        let (ev_tx, ev_rx) = channel();
        let (resp_tx, resp_rx) = channel();
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .spawn(move || self.run_thread(&ev_rx, &resp_tx))?;
        Ok(VcpuHandle {
            index,
            events: ev_tx,
            responses: resp_rx,
            thread: Some(thread),
        })
    }

    /// The thread's body: the state machine of the module's picture, one step per state, until
    /// `Finish` (or the VMM's end of the channel).
    fn run_thread(mut self, events: &Receiver<VcpuEvent>, responses: &Sender<VcpuResponse>) {
        let run = self.fd.get_kvm_run();
        crate::kick::arm(&mut run.immediate_exit as *mut u8);
        let profile = crate::profile::enabled();
        let sampler = profile
            .as_ref()
            .map(|_| crate::profile::Sampler::start(crate::kick::signal()));
        let sampling = sampler.is_some();
        let mut samples = crate::profile::Samples::default();
        let mut state = self.apply_filter(responses);
        loop {
            let next = match state {
                VcpuState::Paused => self.step_paused(events, responses),
                VcpuState::Running => self.step_running(events, responses, sampling, &mut samples),
                VcpuState::Exited => self.step_exited(events, responses),
            };
            let Some(next) = next else {
                break;
            };
            state = next;
        }
        crate::kick::disarm();
        if let (Some(prefix), Some(sampler)) = (profile, sampler) {
            // The sampler thread writes the file (this thread's filter opens no files).
            sampler.stop(samples, format!("{prefix}.vcpu{}", self.index));
        }
    }

    /// Thread step: installs this thread's seccomp filter; the first state, `Exited` (reported
    /// as a vCPU error) if the filter could not be installed.
    fn apply_filter(&self, responses: &Sender<VcpuResponse>) -> VcpuState {
        // The guest's first instruction runs under this thread's filter, or not at all.
        match crate::seccomp::apply(crate::seccomp::ThreadClass::Vcpu) {
            Ok(()) => VcpuState::Paused,
            Err(e) => {
                let detail = format!(
                    "{e}: {}",
                    e.source().map(|s| s.to_string()).unwrap_or_default()
                );
                let _ = responses.send(VcpuResponse::Exited(VmExit::VcpuError {
                    cpu: self.index,
                    detail,
                }));
                let _ = self.exit_evt.write(1);
                VcpuState::Exited
            }
        }
    }

    /// Paused step: waits for the next event and answers it; the next state (`None`: end the
    /// thread).
    fn step_paused(
        &mut self,
        events: &Receiver<VcpuEvent>,
        responses: &Sender<VcpuResponse>,
    ) -> Option<VcpuState> {
        Some(match events.recv() {
            Ok(VcpuEvent::Resume) => {
                self.rearm_lapic_timer();
                reply(
                    responses,
                    VcpuResponse::Resumed(std::time::Instant::now()),
                    VcpuState::Running,
                )
            }
            Ok(VcpuEvent::Pause) => reply(responses, VcpuResponse::Paused, VcpuState::Paused),
            Ok(VcpuEvent::ReportState) => self.report_state(responses, VcpuState::Paused),
            Ok(VcpuEvent::SaveState) => {
                let saved = VcpuKvmState::save(&self.fd, self.index, &self.msr_index_list)
                    .map(Box::new)
                    .map_err(|e| format!("vcpu{}: {e}", self.index));
                reply(responses, VcpuResponse::Saved(saved), VcpuState::Paused)
            }
            Ok(VcpuEvent::Finish) | Err(_) => return None,
        })
    }

    /// Running step: answers a pending event, else runs the guest once (a kick records a
    /// profile sample when `sampling`); the next state (`None`: end the thread).
    fn step_running(
        &mut self,
        events: &Receiver<VcpuEvent>,
        responses: &Sender<VcpuResponse>,
        sampling: bool,
        samples: &mut crate::profile::Samples,
    ) -> Option<VcpuState> {
        Some(match events.try_recv() {
            Ok(VcpuEvent::Pause) => {
                self.complete_pending_io();
                reply(responses, VcpuResponse::Paused, VcpuState::Paused)
            }
            Ok(VcpuEvent::Resume) => reply(
                responses,
                VcpuResponse::Resumed(std::time::Instant::now()),
                VcpuState::Running,
            ),
            Ok(VcpuEvent::ReportState) => self.report_state(responses, VcpuState::Running),
            Ok(VcpuEvent::SaveState) => reply(
                responses,
                VcpuResponse::Saved(Err("the vCPU is running; pause it first".into())),
                VcpuState::Running,
            ),
            Ok(VcpuEvent::Finish) | Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) => match self.run_once() {
                RunOutcome::Continue => VcpuState::Running,
                RunOutcome::Interrupted => {
                    if sampling && let Ok(r) = self.fd.get_regs() {
                        samples.record(r.rip);
                    }
                    VcpuState::Running
                }
                RunOutcome::Stop(exit) => {
                    let _ = responses.send(VcpuResponse::Exited(exit));
                    let _ = self.exit_evt.write(1);
                    VcpuState::Exited
                }
            },
        })
    }

    /// Exited step: nothing runs any more; answers state reports until `Finish` (`None`).
    fn step_exited(
        &self,
        events: &Receiver<VcpuEvent>,
        responses: &Sender<VcpuResponse>,
    ) -> Option<VcpuState> {
        Some(match events.recv() {
            Ok(VcpuEvent::Finish) | Err(_) => return None,
            Ok(VcpuEvent::ReportState) => self.report_state(responses, VcpuState::Exited),
            // Nothing runs any more; say so instead of pretending to resume.
            Ok(_) => VcpuState::Exited,
        })
    }

    /// Writes the LAPIC's TSC deadline back to itself before the vCPU runs again. A deadline
    /// that passed while the vCPU was parked outside `KVM_RUN` was lost on the nested hosts
    /// (the guest then slept until some device interrupt came); written again, KVM arms the
    /// timer anew and fires at once if the deadline is past. Harmless elsewhere: the same value.
    fn rearm_lapic_timer(&self) {
        const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;
        let entry = kvm_bindings::kvm_msr_entry {
            index: MSR_IA32_TSC_DEADLINE,
            ..Default::default()
        };
        let Ok(mut msrs) = kvm_bindings::Msrs::from_entries(&[entry]) else {
            return;
        };
        if matches!(self.fd.get_msrs(&mut msrs), Ok(1))
            && msrs.as_slice().first().is_some_and(|e| e.data != 0)
            && let Err(e) = self.fd.set_msrs(&msrs)
        {
            log::warn!("vcpu{}: re-arm the LAPIC timer: {e}", self.index);
        }
    }

    /// Lets KVM finish an instruction whose PIO/MMIO exit we just handled (an `IN` or MMIO
    /// read gets its data only on the next `KVM_RUN`) without entering the guest, so that the
    /// saved registers are those after the instruction.
    fn complete_pending_io(&mut self) {
        self.fd.set_kvm_immediate_exit(1);
        match self.fd.run() {
            Err(e) if e.errno() == libc::EINTR => {}
            Err(e) => log::warn!("vcpu{}: complete pending I/O: {e}", self.index),
            Ok(exit) => log::warn!("vcpu{}: unexpected exit {exit:?} while pausing", self.index),
        }
        self.fd.set_kvm_immediate_exit(0);
    }

    fn run_once(&mut self) -> RunOutcome {
        let index = self.index;
        match self.fd.run() {
            Ok(VcpuExit::IoIn(port, data)) => {
                if !self.pio.read(u64::from(port), data) {
                    data.fill(0);
                }
                RunOutcome::Continue
            }
            Ok(VcpuExit::IoOut(port, data)) => {
                self.pio.write(u64::from(port), data);
                RunOutcome::Continue
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                if !self.mmio.read(addr, data) {
                    data.fill(0);
                    crate::warn_ratelimited!("vcpu{index}: read of unmapped MMIO {addr:#x}");
                }
                RunOutcome::Continue
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                if !self.mmio.write(addr, data) {
                    crate::warn_ratelimited!("vcpu{index}: write to unmapped MMIO {addr:#x}");
                }
                RunOutcome::Continue
            }
            Ok(VcpuExit::Intr) => RunOutcome::Interrupted,
            Ok(VcpuExit::Shutdown) => {
                let rip = self.fd.get_regs().map(|r| r.rip).unwrap_or(0);
                RunOutcome::Stop(VmExit::TripleFault { cpu: index, rip })
            }
            Ok(VcpuExit::InternalError) => RunOutcome::Stop(self.internal_error()),
            Ok(VcpuExit::FailEntry(reason, _)) => {
                RunOutcome::Stop(VmExit::FailEntry { cpu: index, reason })
            }
            Ok(other) => RunOutcome::Stop(VmExit::VcpuError {
                cpu: index,
                detail: format!("unexpected exit {other:?}"),
            }),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                self.fd.set_kvm_immediate_exit(0);
                RunOutcome::Interrupted
            }
            Err(e) => RunOutcome::Stop(VmExit::VcpuError {
                cpu: index,
                detail: format!("KVM_RUN: {e}"),
            }),
        }
    }

    /// RIP and the instruction bytes there, read through the guest's page tables.
    fn rip_and_insn(&self) -> (u64, Vec<u8>) {
        match (self.fd.get_regs(), self.fd.get_sregs()) {
            (Ok(r), Ok(s)) => {
                let at = s.cs.base.wrapping_add(r.rip);
                (
                    r.rip,
                    read_virt::<_, 16>(&self.mem, s.cr0, s.cr3, s.efer, at),
                )
            }
            _ => (0, Vec::new()),
        }
    }

    fn report_state(&self, responses: &Sender<VcpuResponse>, state: VcpuState) -> VcpuState {
        let (rip, insn) = self.rip_and_insn();
        reply(responses, VcpuResponse::State { rip, insn }, state)
    }

    /// Collects what KVM and guest memory say about an internal error: the suberror, KVM's
    /// data words, the RIP and up to 16 instruction bytes read through the guest page tables.
    fn internal_error(&mut self) -> VmExit {
        let run = self.fd.get_kvm_run();
        // SAFETY: the exit reason is KVM_EXIT_INTERNAL_ERROR, so `internal` is the active
        // member of the union.
        let internal = unsafe { run.__bindgen_anon_1.internal };
        let ndata = (internal.ndata as usize).min(internal.data.len());
        let data = internal.data[..ndata].to_vec();
        let (rip, insn) = self.rip_and_insn();
        VmExit::InternalError {
            cpu: self.index,
            suberror: internal.suberror,
            rip,
            insn,
            data,
        }
    }
}

fn reply(responses: &Sender<VcpuResponse>, r: VcpuResponse, next: VcpuState) -> VcpuState {
    let _ = responses.send(r);
    next
}
