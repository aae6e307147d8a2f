//! Network set-up with the classic ioctls (no netlink, no `ip` process: the guest agent runs
//! this as PID 1 at boot, where every system call and process start costs real time on nested
//! hosts, and airlockd for every sandbox).
//!
//! - [`configure_interface`], [`add_default_route`]: addresses, links, routes (IPv4).
//! - [`open_tap`]: a TAP device in the calling thread's network namespace.
//! - [`new_netns_with_tap`]: a network namespace of its own with a TAP, made on a short-lived
//!   thread (namespaces are per thread), returned as descriptors.

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

/// Sets the hardware (MAC) address of Ethernet interface `name`.
pub fn set_hwaddr(name: &CStr, mac: [u8; 6]) -> io::Result<()> {
    let sock = ioctl_socket()?;
    let mut req = ifreq(name)?;
    // SAFETY: sockaddr is plain old data; all zeroes is a valid value.
    let mut hw: libc::sockaddr = unsafe { std::mem::zeroed() };
    hw.sa_family = libc::ARPHRD_ETHER;
    for (dst, src) in hw.sa_data.iter_mut().zip(mac) {
        *dst = src as libc::c_char;
    }
    req.ifr_ifru.ifru_hwaddr = hw;
    ioctl(&sock, libc::SIOCSIFHWADDR, (&raw mut req).cast())
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

/// `TUNSETIFF` (`_IOW('T', 202, int)`).
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;

/// Opens `/dev/net/tun` as TAP `name` (`IFF_TAP | IFF_NO_PI`: one Ethernet frame per read and
/// write, no extra header) in the calling thread's network namespace. The device lives as long
/// as the descriptor.
pub fn open_tap(name: &CStr) -> io::Result<OwnedFd> {
    // SAFETY: open(2) of a constant path; returns a new descriptor or -1.
    let fd = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    let tun = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short;
    ioctl(&tun, TUNSETIFF, (&raw mut req).cast())?;
    Ok(tun)
}

/// A network namespace of its own and what is in it.
#[derive(Debug)]
pub struct NetnsWithTap {
    /// The namespace (`/proc/thread-self/ns/net` of the thread that made it): `setns` into it,
    /// or let it go once a process lives there.
    pub netns: OwnedFd,
    /// The TAP, `tap_name` in the namespace, up, with `addr` on it.
    pub tap: OwnedFd,
}

/// Makes a network namespace with `lo` up, IPv4 forwarding on (with nowhere to forward to: see
/// the code) and TAP `tap_name` up with `mac` and `addr`/`prefix`, then runs `inside` in it
/// (firewall rules, sockets that are to live there), on a thread of its own (unshare(2) moves
/// only the calling thread; that thread then ends, so no other thread of the process ever runs
/// in the new namespace).
pub fn new_netns_with_tap<T: Send + 'static>(
    tap_name: &'static CStr,
    mac: [u8; 6],
    addr: Ipv4Addr,
    prefix: u8,
    inside: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<(NetnsWithTap, T)> {
    std::thread::Builder::new()
        .name("netns".into())
        .spawn(move || {
            // SAFETY: unshare(2) with CLONE_NEWNET only changes this thread's namespace.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: open(2) of a constant path; returns a new descriptor or -1.
            let fd = unsafe {
                libc::open(
                    c"/proc/thread-self/ns/net".as_ptr(),
                    libc::O_RDONLY | libc::O_CLOEXEC,
                )
            };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `fd` is a new descriptor that nothing else owns.
            let netns = unsafe { OwnedFd::from_raw_fd(fd) };
            configure_interface(c"lo", None)?;
            // Forwarding on, and no route but the TAP's own link: a packet for anywhere else
            // finds no route, and the namespace answers with an ICMP "network unreachable", so
            // the guest's connection fails at once instead of timing out. Nothing can be
            // forwarded: there is nowhere to forward to. (/proc/sys/net is this thread's
            // namespace's.)
            std::fs::write("/proc/sys/net/ipv4/ip_forward", b"1")?;
            let tap = open_tap(tap_name)?;
            set_hwaddr(tap_name, mac)?;
            configure_interface(tap_name, Some((addr, prefix)))?;
            let made = inside()?;
            Ok((NetnsWithTap { netns, tap }, made))
        })?
        .join()
        .map_err(|_| io::Error::other("the namespace thread panicked"))?
}

/// Runs `f` in the network namespace `ns` refers to (a namespace descriptor, or a pidfd: then
/// the namespace that process is in), on a short-lived thread of its own, and returns what it
/// returns (sockets made there stay in that namespace).
pub fn in_netns<T: Send + 'static>(
    ns: std::os::fd::BorrowedFd<'_>,
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    let ns = ns.try_clone_to_owned()?;
    std::thread::Builder::new()
        .name("netns".into())
        .spawn(move || {
            // SAFETY: setns(2) moves only this thread, which ends when `f` returns.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            drop(ns);
            f()
        })?
        .join()
        .map_err(|_| io::Error::other("the namespace thread panicked"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_with_a_tap_has_the_address_and_nothing_else() {
        // SAFETY: geteuid(2) cannot fail and touches no memory.
        let root = unsafe { libc::geteuid() } == 0;
        assert!(
            root && std::path::Path::new("/dev/net/tun").exists(),
            "this test needs root and /dev/net/tun (run the tests as root)"
        );
        let mac = [0x02, 0xa1, 0x0c, 0, 0, 1];
        let (made, inside) =
            new_netns_with_tap(c"tap0", mac, Ipv4Addr::new(100, 96, 0, 1), 30, || {
                std::fs::read_to_string("/proc/thread-self/net/dev")
            })
            .unwrap();
        assert!(
            inside.contains("tap0:"),
            "`inside` runs in the namespace: {inside}"
        );
        // Look at the namespace from a thread that enters it.
        use std::os::fd::AsFd;
        let (devices, routes, address, forwarding) = in_netns(made.netns.as_fd(), || {
            Ok((
                std::fs::read_to_string("/proc/thread-self/net/dev").unwrap(),
                std::fs::read_to_string("/proc/thread-self/net/route").unwrap(),
                {
                    let sock = ioctl_socket().unwrap();
                    let mut req = ifreq(c"tap0").unwrap();
                    ioctl(&sock, libc::SIOCGIFHWADDR, (&raw mut req).cast()).unwrap();
                    // SAFETY: SIOCGIFHWADDR filled in the hwaddr member of the union.
                    let hw = unsafe { req.ifr_ifru.ifru_hwaddr };
                    hw.sa_data[..6]
                        .iter()
                        .map(|b| *b as u8)
                        .collect::<Vec<u8>>()
                },
                std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").unwrap(),
            ))
        })
        .unwrap();
        let mut names: Vec<&str> = devices
            .lines()
            .skip(2)
            .filter_map(|l| l.split(':').next())
            .map(str::trim)
            .collect();
        names.sort_unstable();
        assert_eq!(names, ["lo", "tap0"]);
        assert_eq!(address, mac, "the TAP's MAC address");
        assert_eq!(
            forwarding.trim(),
            "1",
            "forwarding, with nowhere to forward to"
        );
        // This thread's namespace is untouched.
        let ours = std::fs::read_to_string("/proc/thread-self/net/dev").unwrap();
        assert!(
            !ours.lines().any(|l| l.trim_start().starts_with("tap0:")),
            "the TAP is in the caller's namespace: {ours}"
        );
        // One route: the /30 on tap0 (no default route: nothing leaves the namespace).
        let routes: Vec<&str> = routes.lines().skip(1).collect();
        assert_eq!(routes.len(), 1, "{routes:?}");
        // 100.96.0.0/30, as /proc shows it (little-endian hex).
        assert!(routes[0].starts_with("tap0\t00006064\t"), "{routes:?}");
    }
}
