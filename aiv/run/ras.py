"""Floor 5 (runtime): NCCL's own view of a job, from its RAS service (NCCL >= 2.24, on unless NCCL_RAS_ENABLE=0):
every NCCL process of a node can answer for every communicator of the job. Plain TCP text on NCCL_RAS_ADDR
(default localhost:28028): the client sends `CLIENT PROTOCOL 2` (the answer: `SERVER PROTOCOL 2`), `TIMEOUT <s>`
(how long NCCL waits for its peers; `OK`), `SET FORMAT json` (NCCL >= 2.28.7; `OK`), then `STATUS`: one JSON
document, and NCCL closes the connection. Read within a bound, never required: the answer is plain data or
why there is none."""
import json
import re
import socket
import time

RAS_PORT = 28028        # NCCL's default RAS client port
RAS_PROTOCOL = 2        # the client protocol this reader speaks
RAS_MAX_BYTES = 16 << 20


def ras_addr(env):
    """(host, port) of NCCL's RAS client socket: NCCL_RAS_ADDR ('host:port', '[v6]:port', 'host' or ':port'),
    else localhost:28028."""
    spec = (env.get("NCCL_RAS_ADDR") or "").strip()
    if spec.startswith("["):
        host, _, rest = spec[1:].partition("]")
        port = rest.lstrip(":")
    elif spec.count(":") == 1:
        host, _, port = spec.partition(":")
    else:
        host, port = spec, ""
    return host or "localhost", int(port) if port.isdigit() else RAS_PORT


class _Conn:
    """One RAS connection: lines and the rest of the stream, every read and write within the deadline."""

    def __init__(self, sock, end):
        self.sock, self.end, self.buf = sock, end, bytearray()

    def left(self):
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left

    def send(self, line):
        self.sock.settimeout(self.left())
        self.sock.sendall(line.encode() + b"\n")

    def line(self):
        while b"\n" not in self.buf:
            self._recv()
        head, _, self.buf = self.buf.partition(b"\n")
        return head.decode(errors="replace").strip()

    def rest(self):
        """Everything until NCCL closes the connection (the STATUS document)."""
        try:
            while True:
                self._recv()
        except EOFError:
            return self.buf.decode(errors="replace")

    def _recv(self):
        self.sock.settimeout(self.left())
        got = self.sock.recv(65536)
        if not got:
            raise EOFError
        self.buf += got
        if len(self.buf) > RAS_MAX_BYTES:
            raise ValueError(f"more than {RAS_MAX_BYTES >> 20} MiB")


def ras_status(host, port, seconds):
    """NCCL's RAS STATUS as JSON, within `seconds` in all (NCCL is told to wait for its peers one second
    less). -> {'ok': True, 'data': the document, 'secs'} or {'ok': False, 'why': in words}."""
    t0, where = time.monotonic(), f"{host}:{port}"
    end = t0 + seconds
    try:
        sock = socket.create_connection((host, port), timeout=max(0.05, seconds))
    except ConnectionRefusedError:
        return {"ok": False, "why": f"nothing listens on {where} (RAS off: NCCL_RAS_ENABLE=0, NCCL older than 2.24, or "
                                    "no NCCL process on this node any more)"}
    except (TimeoutError, socket.timeout):
        return {"ok": False, "why": f"no connection to {where} within {seconds:g}s"}
    except OSError as e:
        return {"ok": False, "why": f"cannot connect to {where}: {e.strerror or e}"}
    conn, step = _Conn(sock, end), "the handshake"
    # each step: (its name, the line sent, the answer that says yes (a pattern), the words for any other answer)
    steps = (("the handshake", f"CLIENT PROTOCOL {RAS_PROTOCOL}", "SERVER PROTOCOL .*",
              "answered {!r}, not as NCCL's RAS (SERVER PROTOCOL)"),
             ("TIMEOUT", f"TIMEOUT {max(1, int(seconds) - 1)}", "OK", "refused TIMEOUT"),
             ("SET FORMAT json", "SET FORMAT json", "OK", "does not answer in JSON (NCCL older than 2.28.7?): {!r}"))
    try:
        with sock:
            for step, line, yes, no in steps:  # noqa: B007 - the errors below name the step
                conn.send(line)
                answer = conn.line()
                if not re.fullmatch(yes, answer.upper(), re.S):
                    return {"ok": False, "why": f"{where} " + no.format(answer[:60])}
            step = "STATUS"
            conn.send("STATUS")
            text = conn.rest()
    except (TimeoutError, socket.timeout):
        return {"ok": False, "why": f"{where} did not answer {step} within {seconds:g}s"}
    except EOFError:
        return {"ok": False, "why": f"{where} closed the connection during {step}"}
    except (OSError, ValueError) as e:
        return {"ok": False, "why": f"{where} during {step}: {e}"}
    try:
        data = json.loads(text)
    except ValueError:
        return {"ok": False, "why": f"{where} answered STATUS with something that is not JSON ({text[:60]!r})"}
    if not isinstance(data, dict):
        return {"ok": False, "why": f"{where} answered STATUS with JSON that is not a document"}
    return {"ok": True, "data": data, "secs": round(time.monotonic() - t0, 3), "addr": where}
