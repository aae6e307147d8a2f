#!/usr/bin/env bash
# Boots the Airlock guest kernel under QEMU's microvm machine: the reference
# that the boot benchmark compares our VMM against.
#
# Usage: kernel-config/qemu-boot.sh KERNEL ROOTFS [VCPUS]
#   KERNEL  the ELF vmlinux from build.sh (entered through its PVH note)
#   ROOTFS  an ext4 image; its /sbin/init runs as PID 1 (read-only root)
#   VCPUS   number of vCPUs (default 1)
#
# The guest serial console is this script's stdout. QEMU exits when the
# guest resets (reboot=k + -no-reboot), i.e. when init calls
# reboot(RB_AUTOBOOT), and on a guest panic (panic=-1 resets too).
#
# Environment: AIRLOCK_QEMU_MEM (guest MiB, default 512),
#              AIRLOCK_QEMU_APPEND (extra kernel command-line words),
#              AIRLOCK_QEMU_CPU (-cpu value, default qemu64,+xsaveerptr).
set -euo pipefail

usage() {
    printf 'usage: %s KERNEL ROOTFS [VCPUS]\n' "${0##*/}" >&2
    exit 2
}

# The kernel command line our VMM uses. QEMU appends the
# virtio_mmio.device=<size>@<addr>:<irq> declarations itself
# (microvm auto-kernel-cmdline).
kernel_cmdline() {
    local cmdline='console=ttyS0 reboot=k panic=-1 tsc=reliable no_timer_check'
    cmdline+=' clocksource=kvm-clock quiet root=/dev/vda ro rootfstype=ext4'
    cmdline+=' airlock_nested'
    if [[ -n ${AIRLOCK_QEMU_APPEND:-} ]]; then
        cmdline+=" $AIRLOCK_QEMU_APPEND"
    fi
    printf '%s' "$cmdline"
}

# The CPU model. qemu64 defines none of the features the nested host cannot
# emulate in guest kernel mode (XSAVE, SMAP, SMEP, POPCNT, leaf 7), close to
# our VMM's CPU template. (On the nested host that mask does not reach the
# guest for XSAVE/AVX; the kernel hides those itself under airlock_nested,
# see patches/0004.) XSAVEERPTR is added so that the kernel does not apply
# the AMD "FXSAVE leak" workaround (qemu64 is an AMD model), which runs x87
# code (fnclex) the nested host cannot emulate either.
cpu_model() {
    printf '%s' "${AIRLOCK_QEMU_CPU:-qemu64,+xsaveerptr}"
}

main() {
    (($# >= 2 && $# <= 3)) || usage
    local kernel=$1 rootfs=$2 vcpus=${3:-1}
    [[ -r $kernel ]] || { printf 'no kernel at %s\n' "$kernel" >&2; exit 2; }
    [[ -r $rootfs ]] || { printf 'no rootfs image at %s\n' "$rootfs" >&2; exit 2; }
    [[ $vcpus =~ ^[1-9][0-9]*$ ]] || usage

    # microvm without ACPI (the kernel has none; the MP table describes the
    # CPUs), without RTC or second IO-APIC (virtio IRQs on the first one,
    # as the MP table describes), without option ROMs. microvm has no
    # keyboard controller; the i8042 added at the end is what reboot=k
    # pulses to reset the guest (the kernel has no driver bound to it).
    exec qemu-system-x86_64 \
        -M microvm,acpi=off,rtc=off,ioapic2=off,x-option-roms=off \
        -enable-kvm -cpu "$(cpu_model)" \
        -m "${AIRLOCK_QEMU_MEM:-512}" -smp "$vcpus" \
        -nodefaults -no-user-config -display none -no-reboot \
        -serial stdio \
        -kernel "$kernel" -append "$(kernel_cmdline)" \
        -drive "id=root,file=$rootfs,format=raw,if=none,readonly=on" \
        -device virtio-blk-device,drive=root \
        -device i8042
}

main "$@"
