"""Credentials, tokens and home paths never reach the report (sentinel values)."""

from __future__ import annotations

from skylift.doctor.redact import REDACTED, Redactor
from skylift.doctor.render import render_json, render_text
from tests.doctor.recorded import load_facts

SECRET = "SENTINEL-SECRET-4b7d9e"
TOKEN = "SENTINEL-TOKEN-a91c02"
PASSWORD = "SENTINEL-PASS-77f3"
HOME = "/home/sentinel-user"
ENVIRON = {
    "AWS_SECRET_ACCESS_KEY": SECRET,
    "HF_TOKEN": TOKEN,
    "TORCH_HUB_TOKEN": TOKEN,
    "WANDB_API_KEY": SECRET + "x",
    "PATH": "/usr/bin",
}
SENTINELS = (SECRET, TOKEN, PASSWORD, "sentinel-user", "AKIAABCDEFGHIJKLMNOP", "ghp_" + "a" * 36)


def _leaky_facts():
    return load_facts(
        "h100_nvlink_efa",
        environment={
            "TORCH_HUB_TOKEN": TOKEN,
            "TORCH_HOME": f"{HOME}/.cache/torch",
            "NCCL_NET_PLUGIN": f"https://admin:{PASSWORD}@plugins.example/libnccl-net.so",
            "CUDA_CACHE_PATH": f"/Users/someone/cache {SECRET}",
            "FI_EXTRA": "AKIAABCDEFGHIJKLMNOP and ghp_" + "a" * 36,
        },
        notes=[f"config at {HOME}/runs/a.yaml", f"token {TOKEN} leaked into a message"],
    )


def test_text_and_json_carry_no_sentinel():
    redactor = Redactor(ENVIRON, home=HOME)
    facts = _leaky_facts()
    for output in (render_text(facts, [], redactor), render_json(facts, [], redactor)):
        for sentinel in SENTINELS:
            assert sentinel not in output, sentinel
        assert REDACTED in output
        assert "~/.cache/torch" in output and "/Users/<user>" in output
        assert "https://<redacted>@plugins.example" in output


def test_secret_named_variables_are_hidden_whatever_their_value():
    assert Redactor({}, home="/nonexistent").environment({"TORCH_HUB_TOKEN": "short", "NCCL_DEBUG": "INFO"}) == {
        "TORCH_HUB_TOKEN": REDACTED,
        "NCCL_DEBUG": "INFO",
    }


def test_ordinary_text_is_left_alone():
    redactor = Redactor({"SOME_TOKEN": "1"}, home="/root")  # too short to hunt for
    text = "NCCL_SOCKET_IFNAME=eth0 /rootfs/x tokenizers=0.23.3 driver 570.124.06"
    assert redactor.text(text) == text
    assert redactor.text("/root/runs") == "~/runs"
