"""Floor 2: NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME against the host's interfaces, and the lines of NCCL's
own log (interfaces, HCAs, transports, WARNs)."""
import collections
import contextlib
import fcntl
import os
import re
import socket
import struct

from ..core.base import finding, read_text
from ..core.names import nccl_list

SIOCGIFFLAGS, SIOCGIFADDR, IFF_UP = 0x8913, 0x8915, 0x1


def list_interfaces():
    """{name: {'up': bool, 'addrs': [...]}} with the stdlib only."""
    out = {}
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req)[16:18])[0]
            except OSError:
                flags = 0
            addrs = []
            with contextlib.suppress(OSError):
                addrs.append(socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)[20:24]))
            out[name] = {"up": bool(flags & IFF_UP), "addrs": addrs}
    finally:
        s.close()
    for line in (read_text("/proc/net/if_inet6", "") or "").splitlines():
        f = line.split()
        if len(f) >= 6 and f[5] in out and not f[0].startswith("fe80"):
            out[f[5]]["addrs"].append(":".join(f[0][i:i + 4] for i in range(0, 32, 4)))
    return out


def _usable(info):
    return info["up"] and bool(info["addrs"])


def nccl_ifname_select(spec, names):
    """Interfaces NCCL_SOCKET_IFNAME selects: comma list of prefixes; '=' exact; '^' exclude."""
    exclude, exact, pats = nccl_list(spec)
    return [n for n in names if any(n == p if exact else n.startswith(p) for p in pats) != exclude]


def gloo_ifname_select(spec, names):
    """GLOO_SOCKET_IFNAME: comma list of exact names; gloo needs every one. -> (found, missing)."""
    wanted = [p.strip() for p in spec.split(",") if p.strip()]
    return [w for w in wanted if w in names], [w for w in wanted if w not in names]


def check_interfaces(env, ifaces, host):
    """Local check: each *_SOCKET_IFNAME set selects at least one up interface with an address."""
    listed = ", ".join(f"{n}({'up' if i['up'] else 'down'}{':' + i['addrs'][0] if i['addrs'] else ''})"
                       for n, i in sorted(ifaces.items())) or "none"
    out, here = [], f"on {host}; interfaces here: {listed}"
    usable = {n for n, i in ifaces.items() if _usable(i)}
    if "NCCL_SOCKET_IFNAME" in env:
        val = env["NCCL_SOCKET_IFNAME"]
        sel = nccl_ifname_select(val, sorted(ifaces))
        good = [n for n in sel if n in usable]
        why = f"selects {','.join(sel)} but none is up with an address" if sel else "matches no interface"
        text = f"NCCL_SOCKET_IFNAME={val} selects {','.join(good)} on {host}" if good else \
            f"NCCL_SOCKET_IFNAME={val!r} {why} {here}"
        out.append(finding("interface", "PASS" if good else "FAIL", text, [host]))
    if "GLOO_SOCKET_IFNAME" in env:
        val = env["GLOO_SOCKET_IFNAME"]
        found, missing = gloo_ifname_select(val, set(ifaces))
        bad = missing + [n for n in found if n not in usable]
        text = f"GLOO_SOCKET_IFNAME={val} present on {host}" if found and not bad else \
            f"GLOO_SOCKET_IFNAME={val!r}: {','.join(bad) or val} is absent, down or has no address {here}"
        out.append(finding("interface", "PASS" if found and not bad else "FAIL", text, [host]))
    return out


def gloo_address(env, ifaces, hostname=None):
    """The interface and address gloo binds: GLOO_SOCKET_IFNAME's; else, as gloo does, the hostname's
    address when it resolves (Debian maps the hostname to 127.0.1.1, a loopback address), else the
    loopback address. -> {'iface', 'addr', 'how', 'loopback'}."""
    spec = (env.get("GLOO_SOCKET_IFNAME") or "").split(",")[0].strip()
    if spec:
        addrs = (ifaces.get(spec) or {}).get("addrs") or [None]
        out = {"iface": spec, "addr": addrs[0], "how": "GLOO_SOCKET_IFNAME"}
    else:
        host = hostname or socket.gethostname()
        try:
            addr = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
            how = f"hostname {host} resolves to it"
        except OSError:
            addr, how = "127.0.0.1", f"hostname {host} does not resolve: gloo falls back to loopback"
        owner = next((n for n, i in ifaces.items() if addr in i["addrs"]), "lo" if addr.startswith("127.") else "?")
        out = {"iface": owner, "addr": addr, "how": how}
    out["loopback"] = bool(out["addr"]) and (out["addr"].startswith("127.") or out["addr"] == "::1")
    return out


def parse_nccl_ifaces(text):
    """Interfaces NCCL chose, from its INFO lines ('NET/Socket : Using [0]eth0:10.0.0.1<0>')."""
    return sorted({nic for line in re.findall(r"(?:NET/Socket|Bootstrap) ?: Using (.*)", text)
                   for nic in re.findall(r"(?:\[\d+\])?([\w.\-]+:[0-9A-Fa-f.:]+)<\d+>", line)})


def parse_nccl_nics(text):
    """The network devices NCCL listed, by its index: {0: 'mlx5_0', 1: 'mlx5_1:2'} from 'NET/IB : Using
    [0]mlx5_0:1/IB [1]mlx5_1:2/RoCE [RO]; OOB ib0:10.0.0.1<0>' (port 1 left out; a merged device
    '[0]={[0] mlx5_2:1/RoCE, [1] mlx5_3:1/RoCE}' is 'mlx5_2+mlx5_3'). Any network but sockets; the last list."""
    nics = {}
    for line in re.findall(r"NET/(?!Socket\b)[\w.\-]+ ?: Using ([^;\n]*)", text):
        cur = {}
        for idx, body in re.findall(r"\[(\d+)\](=\{[^}]*\}|[^\s\[]+)", line):
            if devs := re.findall(r"([\w.\-]+):(\d+)", body):
                cur[int(idx)] = "+".join(d if p == "1" else f"{d}:{p}" for d, p in devs)
        if cur:
            nics = cur
    return nics


def parse_nccl_hca(text, since=0):
    """The HCA this rank's NCCL traffic went through: the device (parse_nccl_nics) most of its network
    connections used ('Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/2/GDRDMA', 'via NET/IBext_v8/2', PXN
    'via NET/IB/2(5)/GDRDMA'), counted in the log from offset `since` (the latest communicators), else in the
    whole log; ties: the lowest index. None: no network connection of a known device in the log; '': its
    network connections all went over sockets (no HCA carries them)."""
    nics = parse_nccl_nics(text)
    for part in ((text[since:], text) if since else (text,)):
        net = [int(idx) for kind, idx in re.findall(r"\] via NET/([\w.\-]+)/(\d+)", part) if kind != "Socket"]
        counts = collections.Counter(idx for idx in net if idx in nics)
        if counts:
            return nics[max(sorted(counts), key=counts.get)]
        if part and re.search(r"\] via NET/Socket/", part) and not net:
            return ""
    return None


NCCL_WARN_RELAY = 20  # NCCL WARN lines a rank relays to stderr as it exits; the rest are counted


def nccl_warn_lines(text, limit=NCCL_WARN_RELAY):
    """NCCL's own WARN lines of a log: (the first `limit`, how many more)."""
    lines = [ln.rstrip() for ln in text.splitlines() if " NCCL WARN " in ln]
    return lines[:limit], max(0, len(lines) - limit)


def nccl_subsys_hides_channels(spec):
    """Whether NCCL_DEBUG_SUBSYS=spec leaves out the lines that say which transport each channel uses (logged
    under INIT and NET; unset: NCCL's default INIT,BOOTSTRAP,ENV shows them; '^X,Y' leaves out X and Y)."""
    if not spec:
        return False
    names = {s.strip().upper() for s in spec.lstrip("^").split(",")}
    if spec.startswith("^"):
        return {"INIT", "NET"} <= names or "ALL" in names
    return not names & {"INIT", "NET", "ALL"}


def nccl_diag_lines(text, limit=NCCL_WARN_RELAY):
    """NCCL's own diagnostics (NCCL >= 2.31 with NCCL_RUN_DIAGNOSTICS=1: 'host:pid NCCL DIAG <line>'), the first
    `limit`."""
    return [ln.strip() for ln in text.splitlines() if " NCCL DIAG " in ln][:limit]


def nccl_debug_file(env, host=None, pid=None):
    """The operator's NCCL_DEBUG_FILE as NCCL expands it for this process (%h: host name up to the first
    dot, %p: pid, %%: %); None when unset."""
    if not (spec := env.get("NCCL_DEBUG_FILE")):
        return None
    host = (host or socket.gethostname()).split(".")[0]
    return re.sub(r"%([hp%])", lambda m: {"h": host, "p": str(pid or os.getpid()), "%": "%"}[m.group(1)], spec)


NCCL_TRANSPORTS = ("P2P", "SHM", "NET/Socket", "NET/IB", "COLLNET", "NVLS", "NET/other")


def parse_nccl_transport(text):
    """Transports NCCL chose, from its own INFO lines ('Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM')."""
    return sorted({"COLLNET" if k == "CollNet" else "NET/other" if k.startswith("NET/") and k not in NCCL_TRANSPORTS
                   else k for k in re.findall(r" via (P2P|SHM|NET/\w+|COLLNET|CollNet|NVLS)", text)})
