//! Interface and route set-up with the classic ioctls (no netlink, no `ip` process: as PID 1
//! at boot every system call and every process start costs real time on nested hosts).

use std::ffi::CStr;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// A datagram socket to issue interface ioctls on.
fn ioctl_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments returns a new descriptor or -1.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// An `ifreq` naming interface `name` (at most 15 bytes), the rest zero.
fn ifreq(name: &CStr) -> io::Result<libc::ifreq> {
    // SAFETY: ifreq is plain old data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    let bytes = name.to_bytes();
    if bytes.len() >= req.ifr_name.len() {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    for (dst, src) in req.ifr_name.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    Ok(req)
}

fn sockaddr_in(addr: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(addr).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size on Linux; the kernel reads it as the
    // family says.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn ioctl(sock: &OwnedFd, request: libc::c_ulong, arg: *mut libc::c_void) -> io::Result<()> {
    // SAFETY: every caller passes a request whose argument type `arg` points to, and the
    // pointee outlives the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), request, arg) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Brings interface `name` up, and, with `addr`, gives it `addr`/`prefix` first.
pub fn configure_interface(name: &CStr, addr: Option<(Ipv4Addr, u8)>) -> io::Result<()> {
    let sock = ioctl_socket()?;
    if let Some((ip, prefix)) = addr {
        let mut req = ifreq(name)?;
        req.ifr_ifru.ifru_addr = sockaddr_in(ip);
        ioctl(&sock, libc::SIOCSIFADDR, (&raw mut req).cast())?;
        let mask = u32::MAX
            .checked_shl(32 - u32::from(prefix.min(32)))
            .unwrap_or(0);
        let mut req = ifreq(name)?;
        req.ifr_ifru.ifru_netmask = sockaddr_in(Ipv4Addr::from(mask));
        ioctl(&sock, libc::SIOCSIFNETMASK, (&raw mut req).cast())?;
    }
    let mut req = ifreq(name)?;
    ioctl(&sock, libc::SIOCGIFFLAGS, (&raw mut req).cast())?;
    // SAFETY: SIOCGIFFLAGS filled in the flags member of the union.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    req.ifr_ifru.ifru_flags = flags | (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    ioctl(&sock, libc::SIOCSIFFLAGS, (&raw mut req).cast())
}

/// Adds the default route through `gateway`.
pub fn add_default_route(gateway: Ipv4Addr) -> io::Result<()> {
    let sock = ioctl_socket()?;
    // SAFETY: rtentry is plain old data; all zeroes is a valid value.
    let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
    rt.rt_dst = sockaddr_in(Ipv4Addr::UNSPECIFIED);
    rt.rt_genmask = sockaddr_in(Ipv4Addr::UNSPECIFIED);
    rt.rt_gateway = sockaddr_in(gateway);
    rt.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
    ioctl(&sock, libc::SIOCADDRT, (&raw mut rt).cast())
}
