"""N test "hosts" on one Linux machine, made of network namespaces joined by a bridge.

    with Hosts(2, private_dirs=[str(tmp_path)]) as hs:
        srv = hs[0].run([sys.executable, "-m", "http.server", "8000", "--bind", hs[0].addr])
        hs[1].check_output(["curl", f"http://{hs[0].addr}:8000/"])
        hs[0].cut()                   # host 0 loses its link; its processes keep running
        hs[0].restore()
        hs[1].cap(8)                  # 8 Mbit/s each way on host 1's link
    # leaving the block (or close(), or interpreter exit) kills every process and deletes every link/netns

Layout, for Hosts(n, prefix="rt"), with TAG = prefix + 6 random hex digits (unique per instance):
  * root namespace: a bridge TAG+"br", up, with NO address (and IPv6 off), so nothing in a host can route
    anywhere but to the other hosts; and one veth end TAG+"v"+i per host, enslaved to the bridge.
  * namespace TAG+"h"+i (Host.name): the other veth end, named eth0, with address f"{subnet}.{i+1}/24"
    (IPv6 off on it, so the only address on the wire is that one); lo up (127.0.0.1 works inside).
  * Host.run starts `ip netns exec NAME [unshare -m ... mount tmpfs over each private dir] argv` in a new
    session (its own process group); close() SIGKILLs those groups by PID, then SIGKILLs whatever
    `ip netns pids NAME` still lists, then deletes the namespaces, the veths and the bridge, by name.

Needs root, iproute2 (`ip`, `tc` with the tbf qdisc), util-linux (`unshare`). namespaces_refused() says why
not when the machine does not allow it (for pytest.skip). Addresses must stay inside 10.231.0.0/24.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time

__all__ = ["Hosts", "Host", "namespaces_refused", "require_namespaces"]

_IFNAMSIZ = 15          # longest link name Linux accepts


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *args] if netns is None else ["ip", "-n", netns, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def _tc(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["tc", *args] if netns is None else ["ip", "netns", "exec", netns, "tc", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def _ipv6_off(dev: str, netns: str | None = None) -> None:
    """Best effort: no IPv6 (so no fe80:: address, no router solicitations) on `dev`."""
    path = f"/proc/sys/net/ipv6/conf/{dev}/disable_ipv6"
    if netns is None:
        try:
            with open(path, "w") as f:
                f.write("1")
        except OSError:
            pass
    else:
        subprocess.run(["ip", "netns", "exec", netns, "sh", "-c", f"[ -e {path} ] && echo 1 > {path}"],
                       capture_output=True, timeout=30)


def _exited(pid: int) -> bool:
    """True once `pid` (our child) has exited, WITHOUT reaping it: while it is a zombie its PID (and so
    its process-group id) cannot be reused, so killpg(pid) after this still only hits our group."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Host:
    """One network namespace on the Hosts bridge. Made by Hosts, not directly."""

    def __init__(self, name: str, addr: str, veth: str, private_dirs: list[str]):
        self.name = name            # network namespace name
        self.addr = addr            # e.g. "10.231.0.2", on eth0 inside the namespace
        self.veth = veth            # root-namespace end of this host's veth pair
        self.private_dirs = list(private_dirs)
        self.procs: list[subprocess.Popen] = []
        self._holder: subprocess.Popen | None = None     # holds the host's mount namespace

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.addr!r})"

    def command(self, argv: list[str], cwd=None) -> list[str]:
        """`argv` wrapped to run inside this host: its network namespace and, with private_dirs, the
        host's mount namespace, where an empty tmpfs lies over each of those directories. Every
        process of a host shares that one mount namespace (held by a sleeping process made on
        first use), as processes of one machine share its disk."""
        cmd = ["ip", "netns", "exec", self.name]
        if self.private_dirs:
            # entering a mount namespace moves to its root: keep the caller's directory
            cmd += ["nsenter", "-t", str(self._mounts().pid), "-m", f"--wd={cwd or os.getcwd()}", "--"]
        return cmd + [str(a) for a in argv]

    def _mounts(self) -> subprocess.Popen:
        if self._holder is None:
            mounts = " && ".join(f"mkdir -p {shlex.quote(d)} && mount -t tmpfs tmpfs {shlex.quote(d)}"
                                 for d in self.private_dirs)
            self._holder = subprocess.Popen(
                ["ip", "netns", "exec", self.name, "unshare", "-m", "--propagation", "private", "sh", "-c",
                 f"{mounts} && touch /tmp/.{self.name}-mounted; exec sleep infinity"],
                stdin=subprocess.DEVNULL, start_new_session=True)
            self.procs.append(self._holder)
            # ready once its mounts are in place: a file it sees in its tmpfs-free /tmp, for root too
            deadline = time.monotonic() + 10
            while not os.path.exists(f"/tmp/.{self.name}-mounted") and time.monotonic() < deadline:
                time.sleep(0.02)
            with contextlib.suppress(OSError):
                os.unlink(f"/tmp/.{self.name}-mounted")
        return self._holder

    @staticmethod
    def _env(env: dict | None) -> dict | None:
        return None if env is None else {**os.environ, **{k: str(v) for k, v in env.items()}}

    def run(self, argv: list[str], env: dict | None = None, log_path: str | None = None,
            cwd=None) -> subprocess.Popen:
        """Start `argv` inside this host, in a new session (so its PID is its process-group id).
        `env`: variables added to os.environ. `log_path`: stdout and stderr appended there (else
        inherited). The process is remembered and killed by close()."""
        log = open(log_path, "ab") if log_path is not None else None
        try:
            proc = subprocess.Popen(self.command(argv, cwd), env=self._env(env), cwd=cwd, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT if log else None,
                                    start_new_session=True)
        finally:
            if log is not None:
                log.close()
        self.procs.append(proc)
        return proc

    def check_output(self, argv: list[str], timeout: float = 30, env: dict | None = None, cwd=None,
                     input: str | None = None) -> str:
        """Run `argv` to completion inside this host; its stdout as text. Raises CalledProcessError on a
        non-zero exit (stderr attached) and TimeoutExpired after `timeout` s (its process group killed)."""
        proc = subprocess.Popen(self.command(argv, cwd), env=self._env(env), cwd=cwd, text=True,
                                stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(proc.pid, signal.SIGKILL)      # not reaped yet, so the group id is still ours
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(argv, timeout, out, err) from None
        except BaseException:                      # e.g. KeyboardInterrupt: leave nothing running
            if proc.returncode is None:
                _killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, argv, out, err)
        return out

    def stop(self, proc: subprocess.Popen, timeout: float = 10) -> int | None:
        """SIGTERM the process group of `proc`, then SIGKILL it after `timeout` s; returns the exit code."""
        if proc.returncode is not None:       # already reaped: its PID may belong to someone else now
            return proc.returncode
        _killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while not _exited(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        _killpg(proc.pid, signal.SIGKILL)     # also the group's stragglers; the leader is at most a zombie
        return proc.wait()

    def cut(self) -> None:
        """Take this host's link down (at the bridge side); its processes keep running."""
        _ip("link", "set", "dev", self.veth, "down")

    def restore(self) -> None:
        """Undo cut()."""
        _ip("link", "set", "dev", self.veth, "up")

    def cap(self, rate_mbit: float, burst_kb: int = 64, latency_ms: int = 50) -> None:
        """Limit this host's link to `rate_mbit` Mbit/s in each direction (tbf on both veth ends: the root
        end shapes traffic toward the host, eth0 inside the namespace shapes traffic from it)."""
        spec = ["root", "tbf", "rate", f"{max(1, round(rate_mbit * 1000))}kbit", "burst", f"{burst_kb}kb",
                "latency", f"{latency_ms}ms"]
        _tc("qdisc", "replace", "dev", self.veth, *spec)
        _tc("qdisc", "replace", "dev", "eth0", *spec, netns=self.name)

    def uncap(self) -> None:
        """Undo cap() (no error when there is no cap)."""
        _tc("qdisc", "del", "dev", self.veth, "root", check=False)
        _tc("qdisc", "del", "dev", "eth0", "root", netns=self.name, check=False)


class Hosts:
    """`n` hosts (network namespaces) on one bridge; a context manager. See the module docstring."""

    def __init__(self, n: int, prefix: str = "rt", subnet: str = "10.231.0", private_dirs: list[str] = ()):
        if not 1 <= n <= 99:
            raise ValueError(f"n must be in 1..99, got {n}")
        self.tag = f"{prefix}{secrets.token_hex(3)}"
        self.bridge = f"{self.tag}br"
        if len(f"{self.tag}v{n - 1}") > _IFNAMSIZ or len(self.bridge) > _IFNAMSIZ:
            raise ValueError(f"prefix {prefix!r} is too long for {_IFNAMSIZ}-character link names")
        self.subnet = subnet
        self.hosts: list[Host] = [
            Host(f"{self.tag}h{i}", f"{subnet}.{i + 1}", f"{self.tag}v{i}", [os.path.abspath(d) for d in private_dirs])
            for i in range(n)]
        self._closed = False
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge", "stp_state", "0", "forward_delay", "0")
        _ipv6_off(self.bridge)
        _ip("link", "set", "dev", self.bridge, "up")
        for h in self.hosts:
            _ip("netns", "add", h.name)
            _ip("link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.name)
            _ipv6_off(h.veth)
            _ipv6_off("eth0", netns=h.name)
            _ip("link", "set", "dev", h.veth, "master", self.bridge)
            _ip("link", "set", "dev", h.veth, "up")
            _ip("addr", "add", f"{h.addr}/24", "dev", "eth0", netns=h.name)
            _ip("link", "set", "dev", "eth0", "up", netns=h.name)
            _ip("link", "set", "dev", "lo", "up", netns=h.name)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __iter__(self):
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def close(self) -> None:
        """Kill every process in the hosts, delete the namespaces, veths and bridge. Idempotent; tries
        every step even when one fails; never raises (problems are printed to stderr)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        problems: list[str] = []
        for h in self.hosts:                  # 1. the processes we started: SIGKILL their groups, reap
            for p in h.procs:
                if p.returncode is None:      # unreaped, so p.pid is still our group's id
                    _killpg(p.pid, signal.SIGKILL)
            for p in h.procs:
                try:
                    p.wait(timeout=10)
                except Exception as e:        # noqa: BLE001
                    problems.append(f"{h.name}: pid {p.pid}: {e}")
        for h in self.hosts:                  # 2. anything else still living in the namespace
            deadline = time.monotonic() + 10
            while True:
                pids = _netns_pids(h.name)
                if not pids or time.monotonic() > deadline:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                time.sleep(0.05)
            if pids:
                problems.append(f"{h.name}: pids {pids} survived SIGKILL")
        for h in self.hosts:                  # 3. namespaces (takes eth0, and so the veth pair, with it)
            r = _ip("netns", "del", h.name, check=False)
            if r.returncode != 0 and _exists_netns(h.name):
                problems.append(f"ip netns del {h.name}: {r.stderr.strip()}")
        for link in [h.veth for h in self.hosts] + [self.bridge]:   # 4. links, if still there
            if _exists_link(link):
                r = _ip("link", "del", link, check=False)
                if r.returncode != 0 and _exists_link(link):
                    problems.append(f"ip link del {link}: {r.stderr.strip()}")
        if problems:
            print(f"hosts.py: cleanup of {self.tag} incomplete:\n  " + "\n  ".join(problems), file=sys.stderr)

    def leftovers(self) -> list[str]:
        """Names of this instance's namespaces and links that still exist (empty after close())."""
        return ([h.name for h in self.hosts if _exists_netns(h.name)]
                + [x for x in [h.veth for h in self.hosts] + [self.bridge] if _exists_link(x)])


def _netns_pids(name: str) -> list[int]:
    try:
        r = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30)
    except Exception:                         # noqa: BLE001
        return []
    return [int(x) for x in r.stdout.split() if x.isdigit() and int(x) != os.getpid()]


def _exists_netns(name: str) -> bool:
    return os.path.exists(f"/run/netns/{name}")


def _exists_link(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", "dev", name], capture_output=True, timeout=30).returncode == 0


@functools.cache
def namespaces_refused() -> str | None:
    """None when this machine lets us make the hosts (checked once: a probe namespace with a bridge, a
    veth, a tbf qdisc and `unshare -m` inside, then deleted), else the reason, for pytest.skip."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    probe = f"rtprobe{os.getpid()}"
    steps = [
        ["ip", "netns", "add", probe],
        ["ip", "-n", probe, "link", "add", "pb", "type", "bridge"],
        ["ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pz"],
        ["ip", "-n", probe, "link", "set", "dev", "pa", "master", "pb"],
        ["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "pa", "root", "tbf",
         "rate", "1mbit", "burst", "32kb", "latency", "50ms"],
        ["ip", "netns", "exec", probe, "unshare", "-m", "--propagation", "private", "sh", "-c",
         "mount -t tmpfs tmpfs /mnt"],
    ]
    try:
        for cmd in steps:
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired) as e:
                return f"{shlex.join(cmd)}: {e}"
            if r.returncode != 0:
                return f"{shlex.join(cmd)} failed: {r.stderr.strip()}"
        return None
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)


def require_namespaces() -> None:
    """pytest.skip(reason) unless namespaces_refused() is None."""
    reason = namespaces_refused()
    if reason is not None:
        import pytest
        pytest.skip(reason)
