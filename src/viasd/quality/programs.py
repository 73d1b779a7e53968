"""The programs the sandbox (sandbox.py) writes into its temporary directory and runs: the trusted
harness, the untrusted worker (both with the codec of plain values between them) and, with
namespaces, the launcher that is the sandbox's PID 1. Kept as text: they run under another
interpreter (`-I -S`, maybe the system Python as nobody) and never import viasd."""

# Plain values between the two processes below, as strict JSON (exact builtin types only, so no
# object of the program's own class ever reaches the test): int {"i": hex}, float {"f": hex},
# complex {"c": [re, im]}, tuple {"t": [...]}, dict {"d": [[k, v], ...]}, set {"s": [...]},
# frozenset {"z": [...]}, bytes {"b": hex}; str, list, bool and None as themselves.
_CODEC = r"""
def _enc(v):
    t = type(v)
    if v is None or t is bool or t is str:
        return v
    if t is int:
        return {"i": hex(v)}
    if t is float:
        return {"f": v.hex()}
    if t is complex:
        return {"c": [v.real.hex(), v.imag.hex()]}
    if t is list:
        return [_enc(x) for x in v]
    if t is tuple:
        return {"t": [_enc(x) for x in v]}
    if t is dict:
        return {"d": [[_enc(k), _enc(x)] for k, x in v.items()]}
    if t is set or t is frozenset:
        return {"s" if t is set else "z": [_enc(x) for x in v]}
    if t is bytes:
        return {"b": v.hex()}
    raise TypeError("returned a %s, not a plain value (int, float, str, list, tuple, dict, set, bytes, None)" % t.__name__)

def _dec(x):
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is list:
        return [_dec(y) for y in x]
    if t is dict and len(x) == 1:
        (k, y), = x.items()
        if k == "i" and type(y) is str:
            return int(y, 16)
        if k == "f" and type(y) is str:
            return float.fromhex(y)
        if k == "c" and type(y) is list and len(y) == 2:
            return complex(float.fromhex(y[0]), float.fromhex(y[1]))
        if k == "t" and type(y) is list:
            return tuple(_dec(z) for z in y)
        if k == "d" and type(y) is list:
            return {_dec(a): _dec(b) for a, b in y}
        if k == "s" and type(y) is list:
            return set(_dec(z) for z in y)
        if k == "z" and type(y) is list:
            return frozenset(_dec(z) for z in y)
        if k == "b" and type(y) is str:
            return bytes.fromhex(y)
    raise ValueError("not an encoded plain value")
"""

# The sandbox runs two processes. The trusted harness (harness.py) reads its setup - a random
# token, and for HumanEval the test code and the entry point - from fd 3, which it then closes;
# marks itself non-dumpable (no ptrace, /proc/PID/mem or /proc/PID/fd for its peers); and starts
# the untrusted program in a fresh interpreter (worker.py) whose only channels are two pipes, with
# no capabilities. The test runs in the harness: `candidate(...)` is a call sent to the worker,
# and what comes back is decoded as plain data, so an object with its own `__eq__` never reaches
# the test, and nothing of the token or the test is in the program's memory or files. The harness
# writes the token to fd 4 (a pipe the parent reads) only when the test passed (HumanEval) or the
# program ran to its end and exited 0 (a plain program).
HARNESS = r"""
import ctypes, json, os, signal, sys, traceback
""" + _CODEC + r"""
def _read_all(fd):
    chunks = []
    while True:
        b = os.read(fd, 1 << 16)
        if not b:
            return b"".join(chunks)
        chunks.append(b)

class _Remote:
    def __init__(self, name, req, resp):
        self.name, self.req, self.resp = name, req, resp
    def __call__(self, *args, **kwargs):
        line = json.dumps([self.name, [_enc(a) for a in args], {k: _enc(v) for k, v in kwargs.items()}])
        self.req.write(line.encode() + b"\n")
        self.req.flush()
        reply = self.resp.readline(64 << 20)
        if not reply:
            raise RuntimeError("the program died during a call to %s" % self.name)
        reply = json.loads(reply)
        if type(reply) is not list or not reply:
            raise RuntimeError("the program sent a malformed reply")
        if reply[0] == "ok" and len(reply) == 2:
            return _dec(reply[1])
        if reply[0] == "err" and len(reply) == 3 and type(reply[1]) is str and type(reply[2]) is str:
            kind = getattr(__builtins__, reply[1], None) if reply[1].isidentifier() else None
            if not (isinstance(kind, type) and issubclass(kind, Exception)):
                kind = RuntimeError
            raise kind("%s (in the program: %s)" % (reply[2][:200], reply[1]))
        raise RuntimeError("the program sent a malformed reply")

def _high(fd):
    import fcntl
    new = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return new

def _harness():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    setup = json.loads(_read_all(3))
    os.close(3)
    token = setup["token"].encode()
    req_r, req_w = (_high(fd) for fd in os.pipe())
    resp_r, resp_w = (_high(fd) for fd in os.pipe())
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:  # the untrusted side: pipes at fds 3 and 4, nothing else open, no capabilities, then exec
        try:
            os.dup2(req_r, 3)
            os.dup2(resp_w, 4)
            os.closerange(5, 1 << 16)
            for cap in range(64):
                libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP: a root in the namespace keeps no capabilities
            libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
            os.execv(sys.executable, [sys.executable, "-I", "-S", "worker.py"])
        except BaseException as e:
            os.write(2, ("sandbox: %s\n" % e).encode())
        os._exit(126)
    os.close(req_r)
    os.close(resp_w)
    req, resp = os.fdopen(req_w, "wb"), os.fdopen(resp_r, "rb")
    ok = False
    try:
        ready = resp.readline(64)
        if ready == b'["ready"]\n':
            if setup.get("test") is None:
                req.close()
                code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                pid = None
                ok = code == 0
                if not ok:
                    sys.exit(code if code > 0 else 128 - code)
            else:
                ns = {"__name__": "__viasd_test__", "__builtins__": __builtins__}
                exec(compile(setup["test"], "test.py", "exec"), ns)
                candidate = ns[setup["entry_point"]] = _Remote(setup["entry_point"], req, resp)  # the test may call it by name
                ns["check"](candidate)
                ok = True
    except BaseException as e:
        if isinstance(e, SystemExit):
            raise
        sys.stderr.write(traceback.format_exception_only(type(e), e)[-1])
        sys.stderr.flush()
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass
    if not ok:
        sys.exit(1)
    os.write(4, token)
    os.close(4)
_harness()
"""

# The untrusted side: the program, then calls from the harness until it closes the request pipe.
WORKER = r"""
import json, os, sys
""" + _CODEC + r"""
def _worker():
    req, resp = os.fdopen(3, "rb"), os.fdopen(4, "wb")
    with open("program.py", encoding="utf-8") as f:
        code = compile(f.read(), os.path.abspath("program.py"), "exec")
    ns = {"__name__": "__main__", "__file__": os.path.abspath("program.py"), "__builtins__": __builtins__}
    exec(code, ns)
    sys.stdout.flush()
    resp.write(b'["ready"]\n')
    resp.flush()
    for line in req:
        try:
            name, args, kwargs = json.loads(line)
            out = ["ok", _enc(ns[name](*[_dec(a) for a in args], **{k: _dec(v) for k, v in kwargs.items()}))]
        except BaseException as e:
            out = ["err", type(e).__name__, str(e)[:200]]
        resp.write(json.dumps(out).encode() + b"\n")
        resp.flush()
_worker()
"""

# PID 1 of the sandbox's namespaces (runs as root inside them): private tmpfs on /tmp, /var/tmp and
# /dev/shm, then the program as a child (limits, nobody) while PID 1 reaps every process; when the
# program exits PID 1 exits, and the kernel kills whatever is left in the PID namespace.
LAUNCHER = r"""
import ctypes, os, resource, sys
work, python, mem_mb, cpu_s, drop = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
files = {n: open(os.path.join(work, n), "rb").read() for n in ("program.py", "harness.py", "worker.py")}
libc = ctypes.CDLL(None, use_errno=True)
for d in ("/tmp", "/var/tmp", "/dev/shm"):
    if os.path.isdir(d) and libc.mount(b"tmpfs", d.encode(), b"tmpfs", 2 | 4, b"size=64m,mode=1777") != 0:  # nosuid, nodev
        os.write(2, ("sandbox: cannot mount a private tmpfs on %s (errno %d)\n" % (d, ctypes.get_errno())).encode())
        os._exit(125)
home = "/tmp/sandbox"
os.mkdir(home, 0o755)
for n, data in files.items():
    with open(os.path.join(home, n), "wb") as f:
        f.write(data)
if drop:
    os.chown(home, 65534, 65534)
pid = os.fork()
if pid == 0:
    try:
        os.chdir(home)
        resource.setrlimit(resource.RLIMIT_AS, (mem_mb << 20, mem_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        if drop:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        resource.setrlimit(resource.RLIMIT_NPROC, (32, 32))
        os.execve(python, [python, "-I", "-S", "harness.py"], {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": "/tmp"})
    except BaseException as e:
        os.write(2, ("sandbox: %s\n" % e).encode())
    os._exit(126)
while True:  # PID 1 reaps orphans (no zombies), until the program itself is done
    try:
        done, status = os.wait()
    except ChildProcessError:
        os._exit(125)
    if done == pid:
        break
code = os.waitstatus_to_exitcode(status)
os._exit(code if code >= 0 else 128 - code)
"""
