"""Run on a namespace host by tests/test_multihost.py: a push to two servers on other hosts, where
the second server's link is cut once it has prepared (between prepare and commit), then restored.
Prints one JSON line: what the push said, and each server's version and digest after."""
import json
import os
import subprocess
import sys
import time

import httpx
import torch
from transformers import AutoModelForCausalLM

from weight_sync.clients import HttpReceiverClient
from weight_sync.sender import CommitIncomplete, WeightSync


def main(model_path: str, url_a: str, url_b: str, netns_b: str, host: str) -> None:
    token = os.environ["RIPTIDE_API_KEY"]
    auth = {"Authorization": f"Bearer {token}"}

    class CutAfterPrepare(HttpReceiverClient):
        def prepare(self, req):
            super().prepare(req)
            subprocess.run(["ip", "-n", netns_b, "link", "set", "eth0", "down"], check=True)

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)
    sync = WeightSync([HttpReceiverClient(url_a, 5, token), CutAfterPrepare(url_b, 5, token)], timeout_s=5,
                      api_key=token, host=host)
    out = {}
    try:
        try:
            stats = sync.push(model, version=1)
            out["push"] = {"committed_everywhere": True, "serving": stats.serving}
        except CommitIncomplete as e:
            out["push"] = {"committed_everywhere": False, "serving": e.stats.serving,
                           "pending": list(e.stats.pending), "message": str(e)}
        cut_for = 8.0
        time.sleep(cut_for)           # the cut server cannot learn the outcome while its link is down
        subprocess.run(["ip", "-n", netns_b, "link", "set", "eth0", "up"], check=True)
        restored = time.monotonic()
        versions = []
        while time.monotonic() - restored < 60:
            v = int(httpx.get(f"{url_b}/get_weight_version", headers=auth, timeout=5).json()["weight_version"])
            versions.append(v)
            if v == 1:
                break
            time.sleep(0.5)
        out["b_versions_after_restore"] = sorted(set(versions))
        out["b_committed_after_s"] = round(time.monotonic() - restored, 1)
        out["digests"] = [httpx.get(f"{u}/weight_sync/digest", headers=auth, timeout=60).json()["digest"]
                          for u in (url_a, url_b)]
    finally:
        sync.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:6])
