"""tests/hosts.py: network-namespace hosts on one bridge (reachability, cut/restore, tbf caps, private dirs,
and that close() leaves no process, namespace or link behind)."""
import subprocess
import sys
import time

import pytest

from hosts import Hosts, namespaces_refused

pytestmark = pytest.mark.skipif(namespaces_refused() is not None, reason=str(namespaces_refused()))

PORT = 8765
SIZE = 4 * 1024 * 1024
# Prints "STATUS BYTES SECONDS" for one GET, or exits non-zero (URLError / timeout).
FETCH = ("import sys, time, urllib.request\n"
         "t = time.monotonic()\n"
         "r = urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2]))\n"
         "n = len(r.read())\n"
         "print(r.status, n, time.monotonic() - t)\n")


def fetch(host, url, timeout=5.0):
    """(status, bytes, seconds) of a GET of `url` made from inside `host`."""
    status, n, secs = host.check_output([sys.executable, "-c", FETCH, url, str(timeout)],
                                        timeout=timeout + 10).split()
    return int(status), int(n), float(secs)


def wait_fetch(host, url, within=15.0):
    deadline = time.monotonic() + within
    while True:
        try:
            return fetch(host, url, timeout=2)
        except subprocess.CalledProcessError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    www = tmp_path_factory.mktemp("www")
    (www / "big.bin").write_bytes(b"\x5a" * SIZE)
    private = tmp_path_factory.mktemp("private")
    (private / "secret.txt").write_text("root only\n")
    with Hosts(2, private_dirs=[str(private)]) as hs:
        h0 = hs[0]
        h0.run([sys.executable, "-m", "http.server", str(PORT), "--bind", h0.addr],
               cwd=str(www), log_path=str(tmp_path_factory.mktemp("logs") / "http.log"))
        url = f"http://{h0.addr}:{PORT}/big.bin"
        wait_fetch(hs[1], url)
        yield hs, url, private


def test_fetch_between_hosts(env):
    hs, url, _ = env
    assert hs[0].addr == "10.231.0.1" and hs[1].addr == "10.231.0.2"
    status, n, _ = fetch(hs[1], url)
    assert (status, n) == (200, SIZE)
    # the only IPv4 address on the host's link is its own, and nothing routes outside the subnet
    addrs = hs[1].check_output(["ip", "-o", "addr", "show", "dev", "eth0"])
    assert "10.231.0.2/24" in addrs and "inet6" not in addrs
    assert "default" not in hs[1].check_output(["ip", "route"])


def test_cut_and_restore(env):
    hs, url, _ = env
    hs[0].cut()
    try:
        with pytest.raises(subprocess.CalledProcessError):
            fetch(hs[1], url, timeout=1.5)
    finally:
        hs[0].restore()
    assert wait_fetch(hs[1], url)[:2] == (200, SIZE)


@pytest.mark.parametrize("side", [0, 1], ids=["cap-sender", "cap-receiver"])
def test_cap_slows_both_directions(env, side):
    """tbf on the server's host shapes its egress (eth0 in the ns); on the client's host it shapes the
    traffic toward it (the root-side veth)."""
    hs, url, _ = env
    assert fetch(hs[1], url)[2] < 1.5                  # uncapped: a veth moves 4 MB in well under a second
    hs[side].cap(8)
    try:
        status, n, secs = fetch(hs[1], url, timeout=30)
    finally:
        hs[side].uncap()
    assert (status, n) == (200, SIZE)
    assert secs > 2.0, f"4 MB at 8 Mbit/s took only {secs:.2f} s"
    assert fetch(hs[1], url)[2] < 1.5                  # uncap() really removed it


def test_private_dirs(env):
    hs, _, private = env
    assert (private / "secret.txt").exists()
    assert hs[1].check_output(["ls", "-A", str(private)]) == ""
    hs[1].check_output(["sh", "-c", f"echo host > {private}/from_host.txt"])
    assert not (private / "from_host.txt").exists()


def test_close_leaves_nothing():
    hs = Hosts(2)
    names = [h.name for h in hs] + [h.veth for h in hs] + [hs.bridge]
    # a process in its own process group and one that escapes it (setsid): both must die with close()
    p = hs[0].run(["sleep", "300"])
    hs[1].run(["sh", "-c", "setsid sleep 301 & wait"])
    time.sleep(0.3)
    escaped = [int(x) for x in subprocess.run(["ip", "netns", "pids", hs[1].name], capture_output=True,
                                               text=True).stdout.split()]
    assert len(escaped) >= 2
    hs.close()
    hs.close()                                          # idempotent
    assert p.returncode is not None
    for pid in escaped:
        try:
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().split(") ")[1][0] in "ZX", f"pid {pid} still running"
        except FileNotFoundError:
            pass
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not [x for x in names if x in netns or f" {x}:" in links or f" {x}@" in links]
    assert hs.leftovers() == []
