"""Ratios, targets and the markdown table of the data-loading benchmark."""

from __future__ import annotations

from typing import Any

__all__ = ["TARGET_DATA_WAIT_SHARE", "TARGET_LATENCY_RATIO", "add_ratios", "check_targets", "markdown_table"]

TARGET_LATENCY_RATIO = 10.0  # skylift vs per-object, with first-byte latency
TARGET_PEER_RATIO = 1.0  # skylift vs the best of WebDataset and MosaicML Streaming
TARGET_DATA_WAIT_SHARE = 0.05
PEERS = ("webdataset", "mosaic")
LABELS = {
    "per_object": "(a) per-object GET + DataLoader",
    "skylift": "(b) skylift streaming",
    "webdataset": "(c) WebDataset",
    "mosaic": "(d) MosaicML Streaming",
}


def add_ratios(conditions: dict[str, Any]) -> None:
    """``ratio_to_per_object`` beside every figure (same condition, same mode)."""
    for condition in conditions.values():
        contenders = condition["contenders"]
        for by_mode in contenders.values():
            for mode, figures in by_mode.items():
                reference = contenders.get("per_object", {}).get(mode)
                if reference and reference["samples_per_s"]:
                    figures["ratio_to_per_object"] = round(figures["samples_per_s"] / reference["samples_per_s"], 2)


def check_targets(conditions: dict[str, Any], data_wait: dict[str, Any]) -> dict[str, Any]:
    targets: dict[str, Any] = {}
    for name, condition in conditions.items():
        contenders = condition["contenders"]
        skylift = contenders.get("skylift", {})
        for mode, figures in skylift.items():
            if condition["latency_s"] > 0 and "ratio_to_per_object" in figures:
                targets[f"{name}/{mode}: skylift >= {TARGET_LATENCY_RATIO:g}x per_object"] = {
                    "measured": figures["ratio_to_per_object"], "met": figures["ratio_to_per_object"] >= TARGET_LATENCY_RATIO,
                }  # fmt: skip
            peers = [contenders[peer][mode] for peer in PEERS if mode in contenders.get(peer, {})]
            if peers:
                ratio = round(figures["samples_per_s"] / max(peer["samples_per_s"] for peer in peers), 3)
                steady = figures["steady_samples_per_s"] / max(peer["steady_samples_per_s"] for peer in peers)
                targets[f"{name}/{mode}: skylift >= {TARGET_PEER_RATIO:g}x best of webdataset, mosaic"] = {
                    "measured": ratio, "met": ratio >= TARGET_PEER_RATIO, "measured_steady": round(steady, 3),
                }  # fmt: skip
    for name, wait in data_wait.items():
        targets[f"{name}: ResNet-18 data wait <= {TARGET_DATA_WAIT_SHARE:.0%} of step time"] = {
            "measured": wait["data_wait_share"], "met": wait["data_wait_share"] <= TARGET_DATA_WAIT_SHARE,
            "measured_after_first_step": wait["data_wait_share_after_first_step"],
        }  # fmt: skip
    return targets


def markdown_table(conditions: dict[str, Any]) -> str:
    lines = [
        (
            "| condition | contender | bytes: samples/s | MB/s | x per-object | steady samples/s | first batch s "
            "| decoded: samples/s | x per-object | moto CPU share (bytes / decoded) |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, condition in conditions.items():
        for contender, by_mode in condition["contenders"].items():
            raw, decoded = by_mode.get("bytes", {}), by_mode.get("decoded", {})
            cells = [
                name, LABELS.get(contender, contender), _cell(raw, "samples_per_s"), _cell(raw, "mb_per_s"),
                _cell(raw, "ratio_to_per_object"), _cell(raw, "steady_samples_per_s"), _cell(raw, "first_batch_s"),
                _cell(decoded, "samples_per_s"), _cell(decoded, "ratio_to_per_object"),
                f"{_cell(raw, 'moto_cpu_share')} / {_cell(decoded, 'moto_cpu_share')}",
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(figures: dict[str, Any], key: str) -> str:
    value = figures.get(key)
    if value is None:
        return "-"
    if isinstance(value, float) and value < 10:
        return f"{value:.2f}"
    return f"{value:,.1f}" if isinstance(value, float) else str(value)
