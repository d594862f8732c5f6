"""``distributed.strategy: fsdp``: FSDP2 sharding in the Trainer and the Runtime.

Two arguments for exactness, both checked here in real gloo processes:

- A 2-rank FSDP step does the arithmetic of a 2-rank DDP step. Each rank's forward and
  backward run on the same full weights (all-gathered, not recomputed) and the same
  kernels; the gradient reduction is one addition of two addends, which is commutative
  (a + b = b + a in IEEE arithmetic), and the averaging divides by 2, which is exact,
  whichever side of the addition FSDP and DDP divide on; AdamW is elementwise, so a slice
  of it is the slice of the whole. The one reduction that is *not* the same is the
  gradient norm for clipping (DDP sums whole tensors, FSDP sums slices and then ranks),
  so skylift sums its squares in fp64 and rounds the root once to fp32 under both: the
  fp64 sums differ by ~1e-16 relative, far below fp32's 6e-8 rounding step, so both
  round to the same fp32 norm. Hence the runs are asserted equal bit for bit: every
  step's loss and gradient norm, the evaluation, and the final weights.
- Measured before that fix, with torch's own fp32 ``clip_grad_norm_`` on both sides: the
  norms differed by up to 7.2e-7 (3 ulp) and the weights by 6e-8 after 6 steps.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from skylift.config.distributed import FsdpConfig
from skylift.data.sampler import ShardedEvalSampler
from skylift.errors import SkyliftConfigError
from skylift.train.precision import PrecisionPolicy
from skylift.train.sharding import (
    DEFAULT_BLOCK_TYPES,
    check_sharding_options,
    mixed_precision,
    select_blocks,
)
from tests.checkpoint.runs import lean_train, records, state_kept, summary, train_arguments
from tests.conftest import run_cli
from tests.gloo_group import join, spawn_ranks

FP32 = PrecisionPolicy("fp32", None, False, False, "test")
BF16 = PrecisionPolicy("bf16", torch.bfloat16, False, False, "test")
FP16 = PrecisionPolicy("fp16", torch.float16, True, False, "test")


# -- block selection and settings (no process group) ---------------------------------


def test_default_blocks_of_a_resnet_are_its_residual_blocks_innermost_first():
    import torchvision

    model = torchvision.models.resnet18(num_classes=4)
    blocks = select_blocks(model, [])
    expected = [module for module in model.modules() if type(module).__name__ in DEFAULT_BLOCK_TYPES]
    assert len(blocks) == len(expected) > 0
    assert {id(block) for block in blocks} == {id(block) for block in expected}
    assert blocks[0] is expected[-1]  # the last block first: children before their parents


def test_nested_blocks_come_before_the_block_that_holds_them():
    inner = nn.Sequential(nn.Linear(2, 2))
    outer = nn.Sequential(inner, nn.ReLU())
    model = nn.Sequential(outer, nn.Linear(2, 2))
    blocks = select_blocks(model, ["Sequential"])
    assert blocks == [inner, outer]  # the root is never one of its own blocks


def test_a_hugging_face_model_names_its_own_blocks():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2)

    class Model(nn.Module):
        _no_split_modules = ["Layer"]

        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer(), Layer()])
            self.encoder = nn.TransformerEncoderLayer(4, 1)  # a default type, overruled by the model's list

    model = Model()
    assert select_blocks(model, []) == list(reversed(model.layers))


def test_a_model_without_known_blocks_is_one_unit():
    assert select_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), []) == []


def test_block_types_that_match_nothing_list_the_model_classes():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.GroupNorm(1, 2))
    with pytest.raises(SkyliftConfigError) as error:
        select_blocks(model, ["Conv2d", "LlamaDecoderLayer"])
    message = str(error.value)
    assert "distributed.fsdp.block_types: LlamaDecoderLayer name no module of Sequential" in message
    assert "Conv2d, GroupNorm, Sequential" in message


def test_precision_decides_the_mixed_precision_policy():
    assert mixed_precision(FP32, "fp32").param_dtype is None
    assert mixed_precision(FP32, "fp32").reduce_dtype is None  # no policy: the unsharded arithmetic
    bf16 = mixed_precision(BF16, "fp32")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision(BF16, "bf16").reduce_dtype is torch.bfloat16
    assert mixed_precision(FP16, "fp32").param_dtype is torch.float16
    assert mixed_precision(FP32, "bf16").reduce_dtype is torch.bfloat16  # asked for: honoured


def test_what_fsdp_cannot_train_is_refused_all_at_once():
    with pytest.raises(SkyliftConfigError) as error:
        check_sharding_options(precision="fp16", channels_last=True, cpu_offload=True, ema_decay=0.999)
    problems = error.value.problems
    assert len(problems) == 3
    assert problems[0].startswith("optim.ema_decay with distributed.strategy: fsdp")
    assert problems[1].startswith("channels_last with distributed.strategy: fsdp")
    assert problems[2].startswith("precision: fp16 with distributed.fsdp.cpu_offload")
    check_sharding_options(precision="fp16", channels_last=False, cpu_offload=False)  # fp16 alone trains


def test_a_refused_setting_stops_skylift_run_before_training(cli_here, tmp_path):
    result = cli_here("run", "examples/quickstart.yaml", "--no-doctor", "--set", f"run_dir={tmp_path}",
                      "--set", "distributed.strategy=fsdp", "--set", "optim.ema_decay=0.99")
    assert result.returncode == 2, result.stderr
    assert "optim.ema_decay with distributed.strategy: fsdp" in result.stderr
    assert "set optim.ema_decay: null, or strategy: ddp" in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_dry_run_refuses_what_fsdp_cannot_train_before_any_worker(cli_here, tmp_path):
    result = cli_here("run", "examples/quickstart.yaml", "--dry-run", "--set", f"run_dir={tmp_path}",
                      "--set", "distributed.strategy=fsdp", "--set", "optim.ema_decay=0.99",
                      "--set", "channels_last=true")
    assert result.returncode == 2, result.stderr
    assert "optim.ema_decay with distributed.strategy: fsdp" in result.stderr
    assert "channels_last with distributed.strategy: fsdp" in result.stderr


def test_unknown_block_types_stop_a_one_rank_run(cli_here, tmp_path):
    result = cli_here("run", "examples/quickstart.yaml", "--no-doctor", "--set", f"run_dir={tmp_path}",
                      "--set", "distributed.strategy=fsdp", "--set", "distributed.fsdp.block_types=[Block]",
                      "--set", "checkpoint.enabled=false")
    assert result.returncode == 2, result.stderr
    assert "distributed.fsdp.block_types: Block name no module of SmallCNN" in result.stderr
    assert "Conv2d, GroupNorm, Linear, MaxPool2d, ReLU, Sequential, SmallCNN" in result.stderr
    assert not dist.is_initialized()  # the one-rank group the run made is gone again


# -- the collectives sharding changes, in 2 real gloo processes ----------------------


def _spawn(task: str, world_size: int, out: Path) -> None:
    spawn_ranks(_worker, world_size, task, str(out))


def _worker(rank: int, world_size: int, port: int, task: str, out: str) -> None:
    join(rank, world_size, port)
    try:
        result = globals()[task](rank, world_size)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    # Widths not divisible by 2, so the slices are uneven (FSDP pads the last one).
    return nn.Sequential(nn.Linear(5, 11), nn.Tanh(), nn.Linear(11, 11), nn.LayerNorm(11), nn.Linear(11, 3))


def _sharded(model: nn.Module, block_types: tuple[str, ...] = ("Linear",)):
    from skylift.train.sharding import Sharding

    sharding = Sharding(FsdpConfig(block_types=list(block_types)), FP32, torch.device("cpu"))
    return sharding, sharding.apply(model)


def _norms_and_clipping(rank: int, world_size: int) -> dict:
    from skylift.train.sharding import clip_gradients, global_grad_norm, local_gradients

    model = _small_model()
    _, model = _sharded(model)
    torch.manual_seed(1 + rank)  # each rank its own batch, as data parallelism has it
    model(torch.randn(7, 5)).square().mean().backward()
    parameters = list(model.parameters())
    full = [parameter.grad.full_tensor() for parameter in parameters]  # the reduced gradients, whole
    sharded_norm = global_grad_norm(local_gradients(parameters), torch.device("cpu"), sharded=True,
                                    reduce_device=torch.device("cpu"))  # fmt: skip
    whole_norm = global_grad_norm(full, torch.device("cpu"), sharded=False, reduce_device=torch.device("cpu"))
    torch_norm = torch.nn.utils.get_total_norm(full)
    max_norm = float(sharded_norm) / 3  # so the clip scales
    clip_gradients(local_gradients(parameters), max_norm, sharded_norm)
    clipped = [parameter.grad.full_tensor() for parameter in parameters]
    references = [nn.Parameter(torch.zeros_like(gradient)) for gradient in full]
    for reference, gradient in zip(references, full, strict=True):
        reference.grad = gradient.clone()
    torch.nn.utils.clip_grads_with_norm_(references, max_norm, sharded_norm)
    return {
        "sharded_norm": float(sharded_norm), "whole_norm": float(whole_norm), "torch_norm": float(torch_norm),
        "elements": sum(gradient.numel() for gradient in full), "norm_is_plain": type(sharded_norm) is torch.Tensor,
        "clipped_like_torch": all(torch.equal(a, b.grad) for a, b in zip(clipped, references, strict=True)),
    }


def _lockstep(rank: int, world_size: int) -> dict:
    from skylift.train.sharding import lockstep

    uneven = [["a", "b"], ["c"]][rank]
    paired = [[batch, counted] for batch, counted in lockstep(uneven, torch.device("cpu"), rank)]
    try:
        list(lockstep([["a"], []][rank], torch.device("cpu"), rank))
        empty_error = None
    except SkyliftConfigError as error:
        empty_error = str(error)
    return {"paired": paired, "empty_error": empty_error}


def _fp16_overflow_on_one_rank(rank: int, world_size: int) -> dict:
    """An inf in rank 1's slice only: the scaler must skip the step on every rank."""
    from skylift.loop.distributed import DistributedContext
    from skylift.train.gradient_step import GradientStep
    from skylift.train.sharding import Sharding

    sharding = Sharding(FsdpConfig(block_types=["Linear"]), FP16, torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    step = GradientStep(grad_clip_norm=1.0, scaler=scaler, sharding=sharding)
    model = step.wrap(_small_model(), DistributedContext(rank, world_size, rank, torch.device("cpu"), "gloo"))
    step.optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [parameter.detach().to_local().clone() for parameter in model.parameters()]
    torch.manual_seed(1 + rank)
    step.before_forward()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 5)).float().square().mean()
    step.backward(loss)
    if rank == 1:
        next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
    stepped = step.step()
    after = [parameter.detach().to_local() for parameter in model.parameters()]
    return {"stepped": stepped, "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
            "scale": scaler.get_scale(), "init_scale": 2.0**10}


def _tied_weights_and_the_optimizer(rank: int, world_size: int) -> dict:
    from safetensors.torch import save_model

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(10, 6)
            self.block = nn.Linear(6, 6)
            self.head = nn.Linear(6, 10, bias=False)
            self.head.weight = self.embedding.weight

        def forward(self, tokens):
            return self.head(self.block(self.embedding(tokens)))

    torch.manual_seed(0)
    model = Tied()
    unsharded = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)  # built before sharding, as own loops do
    sharding, model = _sharded(model, block_types=())  # the tied pair stays in the root's unit
    sharding.adopt_optimizer(optimizer)
    adopted = all(type(p).__name__ == "DTensor" for group in optimizer.param_groups for p in group["params"])
    before = model.block.weight.full_tensor().clone()
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    optimizer.step()
    moved = not torch.equal(before, model.block.weight.full_tensor())
    state = sharding.full_state_dict(model)
    path = Path(os.environ.get("TMPDIR", "/tmp"), f"skylift-tied-{os.getpid()}.safetensors")
    save_model(unsharded, str(path))
    expected_names = sorted(load_file(path))
    path.unlink()
    return {"adopted": adopted, "moved": moved, "names": sorted(state), "expected_names": expected_names}


def _meta_initialisation(rank: int, world_size: int) -> dict:
    """Built on meta, sharded, each rank loading only its rows from a safetensors folder."""
    from safetensors.torch import save_file

    from skylift.train.sharding import Sharding

    folder = Path(os.environ["SKYLIFT_TEST_FOLDER"], "weights")
    folder.mkdir(exist_ok=True)
    whole = _small_model()
    if rank == 0:
        save_file({name: tensor.contiguous() for name, tensor in whole.state_dict().items()},
                  str(folder / "model.safetensors"))  # fmt: skip
    dist.barrier()
    with torch.device("meta"):
        model = _small_model()
    sharding = Sharding(FsdpConfig(block_types=["Linear"]), FP32, torch.device("cpu"))
    sharding.weights_source = folder
    model = sharding.apply(model)
    sharded = model.state_dict()
    equal = all(torch.equal(sharded[name].full_tensor(), tensor) for name, tensor in whole.state_dict().items())
    with torch.device("meta"):
        incomplete = _small_model()
        incomplete.append(nn.Linear(3, 2))  # "5.weight" and "5.bias": in no file
    sharding = Sharding(FsdpConfig(), FP32, torch.device("cpu"))
    sharding.weights_source = folder
    try:
        sharding.apply(incomplete)
        missing_error = None
    except SkyliftConfigError as error:
        missing_error = str(error)
    return {"equal": equal, "missing_error": missing_error}


def _cpu_offload(rank: int, world_size: int) -> dict:
    """One AdamW step with the shards in host memory and one without: on a CPU device the
    arithmetic is the same, so the weights must be too."""
    from skylift.train.sharding import Sharding

    weights = []
    for offload in (False, True):
        sharding = Sharding(FsdpConfig(block_types=["Linear"], cpu_offload=offload), FP32, torch.device("cpu"))
        model = sharding.apply(_small_model())
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        torch.manual_seed(1 + rank)
        model(torch.randn(4, 5)).square().mean().backward()
        optimizer.step()
        weights.append([parameter.full_tensor() for parameter in model.parameters()])
    return {"equal": all(torch.equal(a, b) for a, b in zip(*weights, strict=True))}


@pytest.fixture(scope="module")
def collectives(tmp_path_factory):
    """One 2-rank spawn runs every collective case (a spawn costs seconds of imports)."""
    out = tmp_path_factory.mktemp("collectives")
    os.environ["SKYLIFT_TEST_FOLDER"] = str(out)  # the spawned ranks inherit it
    _spawn("_all_cases", 2, out)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def _all_cases(rank: int, world_size: int) -> dict:
    return {name: globals()[f"_{name}"](rank, world_size)
            for name in ("norms_and_clipping", "lockstep", "fp16_overflow_on_one_rank",
                         "tied_weights_and_the_optimizer", "meta_initialisation", "cpu_offload")}  # fmt: skip


@pytest.mark.multiprocess
def test_the_norm_over_slices_is_the_norm_over_whole_gradients(collectives):
    for rank in collectives:
        case = rank["norms_and_clipping"]
        assert case["sharded_norm"] == case["whole_norm"]  # fp64 sums, one rounding: bitwise
        # torch sums the n squares in fp32: a relative error of at most (n - 1) x 2**-24 (the
        # unit roundoff) in the sum, half that in its square root.
        assert math.isclose(case["torch_norm"], case["sharded_norm"], rel_tol=case["elements"] * 2**-24)
        assert case["norm_is_plain"]  # what the monitor logs, not a DTensor
        assert case["clipped_like_torch"]
    assert collectives[0]["norms_and_clipping"]["sharded_norm"] == collectives[1]["norms_and_clipping"]["sharded_norm"]


@pytest.mark.multiprocess
def test_evaluation_pairs_every_forward_across_ranks(collectives):
    assert collectives[0]["lockstep"]["paired"] == [["a", True], ["b", True]]
    assert collectives[1]["lockstep"]["paired"] == [["c", True], ["c", False]]  # repeated, not counted
    for rank, case in enumerate(collectives):
        assert f"this is rank {rank}) has no evaluation batch" in case["lockstep"]["empty_error"]


@pytest.mark.multiprocess
def test_an_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(collectives):
    for rank in collectives:
        case = rank["fp16_overflow_on_one_rank"]
        assert case["stepped"] and case["unchanged"]
        assert case["scale"] == case["init_scale"] / 2  # GradScaler's backoff, on both ranks


@pytest.mark.multiprocess
def test_tied_weights_are_saved_once_and_the_optimizer_follows_the_shards(collectives):
    main = collectives[0]["tied_weights_and_the_optimizer"]
    assert main["adopted"] and main["moved"]
    assert main["names"] == main["expected_names"]  # what save_model writes for the unsharded model
    assert collectives[1]["tied_weights_and_the_optimizer"]["names"] == []  # gathered on rank 0 only


@pytest.mark.multiprocess
def test_a_model_built_on_meta_loads_only_its_shards(collectives):
    for rank in collectives:
        case = rank["meta_initialisation"]
        assert case["equal"]  # every gathered tensor is the saved one
        assert "holds no tensor for 5.bias, 5.weight\n" in case["missing_error"]


@pytest.mark.multiprocess
def test_cpu_offload_steps_as_without_it(collectives):
    assert all(rank["cpu_offload"]["equal"] for rank in collectives)


# -- whole runs: FSDP equals DDP, bit for bit ------------------------------------------

COMPARED = (
    "schedule.max_steps=16",
    "schedule.warmup_steps=4",
    "accumulation.steps=2",
    "optim.grad_clip_norm=1.0",
    "checkpoint.enabled=false",  # sharded checkpoints have their own tests (tests/checkpoint)
    "monitor.log_every_steps=4",
    # 359 validation digits: rank 0 scores 180, rank 1 179; in batches of 179 rank 0 has two
    # and rank 1 one, so FSDP's evaluation must pair rank 1's missing forward.
    "data.eval_batch_size=179",
    "distributed.fsdp.block_types=[Sequential]",  # SmallCNN's three blocks inside `features`: nested
)


@pytest.fixture(scope="module")
def strategies(tmp_path_factory):
    root = tmp_path_factory.mktemp("strategies")
    runs = {"ddp": ("distributed.strategy=ddp",), "fsdp": ("distributed.strategy=fsdp",),
            "fsdp_checkpointed": ("distributed.strategy=fsdp", "activation_checkpointing.enabled=true",
                                  "activation_checkpointing.module_types=[Sequential]")}  # fmt: skip
    logs = {}
    for name, overrides in runs.items():
        result = lean_train(root / name, *COMPARED, *overrides, nproc=2)
        assert result.returncode == 0, result.stderr[-4000:]
        logs[name] = result.stderr
    return {name: root / name for name in runs}, logs


def _assert_same_weights(run_dir: Path, reference_dir: Path) -> None:
    weights, reference = load_file(run_dir / "model.safetensors"), load_file(reference_dir / "model.safetensors")
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(weights[name], tensor), name


def _train_records(run_dir: Path) -> list[dict]:
    return [{key: record[key] for key in ("step", "loss", "grad_norm")} for record in records(run_dir, "train")]


def test_the_validation_shards_are_uneven():
    """The premise of the evaluation check in the runs below."""
    from skylift.data.datasets import digits

    count = len(digits(0.2, 0).val)
    batches = [len(ShardedEvalSampler(count, 179, rank=rank, world_size=2)) for rank in range(2)]
    assert batches[0] != batches[1]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["fsdp", "fsdp_checkpointed"])
def test_an_fsdp_run_equals_the_ddp_run_bit_for_bit(strategies, run):
    from skylift.recipes.image_classification import SmallCNN

    folders, logs = strategies
    reference, sharded = folders["ddp"], folders[run]
    blocks = sum(isinstance(module, nn.Sequential) for module in SmallCNN(1, 10).modules())
    assert f"fsdp: {blocks} block(s) of Sequential sharded over 2 rank(s), then the root" in logs[run]
    want, got = _train_records(reference), _train_records(sharded)
    assert len(got) == 16
    assert got == want  # every step's loss and gradient norm
    assert max(record["grad_norm"] for record in want) > 1.0  # clipping did scale some steps
    _assert_same_weights(sharded, reference)
    assert summary(sharded)["eval_metrics"] == summary(reference)["eval_metrics"]
    assert summary(sharded)["replicas_agree"] is None  # no replicas under FSDP
    assert summary(reference)["replicas_agree"] is True


# -- a hand-written loop on the Runtime ------------------------------------------------

OWN_LOOP = ("precision=fp32", "deterministic=true", "schedule.epochs=1", "checkpoint.enabled=false",
            "monitor.log_every_steps=1", "monitor.tensorboard=false", "monitor.report=false")


def _own_loop(run_dir: Path, strategy: str):
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    command = [sys.executable, "-m", "skylift", "launch", "--nproc", "2", "--", "python", "examples/own_loop.py",
               "examples/own_loop.yaml", f"run_dir={run_dir}", f"distributed.strategy={strategy}", *OWN_LOOP]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_own_loop_under_fsdp_equals_it_under_ddp(tmp_path):
    """``examples/own_loop.py`` unchanged: its optimizer, built before ``runtime.prepare``, is
    moved onto the shards; accumulation 4 and clipping at 1.0 (the example's config); the
    final weights are gathered for rank 0 to write."""
    for strategy in ("ddp", "fsdp"):
        result = _own_loop(tmp_path / strategy, strategy)
        assert result.returncode == 0, result.stderr[-4000:]
    assert _train_records(tmp_path / "fsdp") == _train_records(tmp_path / "ddp")
    _assert_same_weights(tmp_path / "fsdp", tmp_path / "ddp")


@pytest.mark.slow
def test_compile_under_fsdp_compiles_the_innermost_blocks(cli_here, tmp_path):
    """One rank, nested blocks: the three inner ``Sequential`` blocks are compiled, the one
    holding them is not (its sharded children would break its graph). Both runs in this
    process (``state_kept``: one thread): graphs and names are under test, not a process start.
    dynamo is reset around each run, so the compiled one compiles from nothing as a fresh
    process does; ``compile_threads=1`` builds the kernels here, not in a pool of workers that
    would outlive the test (it decides where kernels are built, not what they compute)."""
    import torch._dynamo
    import torch._inductor.config

    cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    compiled_before = len(list(cache.rglob("*.py"))) if cache.exists() else 0
    overrides = ("distributed.strategy=fsdp", "distributed.fsdp.block_types=[Sequential]", "schedule.max_steps=4",
                 "schedule.warmup_steps=2", "checkpoint.enabled=false")
    for name, extra in (("eager", ()), ("compiled", ("compile.enabled=true",))):
        torch._dynamo.reset()
        try:
            # torch's own patch, not monkeypatch: pytest 9.2's undo deletes an attribute that was
            # not in the module's __dict__, and a deleted inductor setting stays hidden from every
            # later compile in this worker ("compile_threads does not exist").
            with state_kept(), torch._inductor.config.patch(compile_threads=1):
                result = cli_here(*train_arguments(tmp_path / name, *overrides, *extra, lean=True))
        finally:
            torch._dynamo.reset()
        assert result.returncode == 0, result.stderr[-4000:]
        assert not dist.is_initialized()  # the run's one-rank group is gone: nothing leaks to later tests
    assert len(list(cache.rglob("*.py"))) > compiled_before  # inductor wrote kernels
    eager, compiled = (load_file(tmp_path / name / "model.safetensors") for name in ("eager", "compiled"))
    assert compiled.keys() == eager.keys()  # compiled in place: no _orig_mod. in the names
    # Compilation reorders floating-point sums (fused normalisation and pooling); reordering
    # a sum of n terms moves it by at most n x 2**-24 relative. The longest sum in SmallCNN
    # is a 3x3 convolution over 64 channels: 576 products. Measured: equal, or 1 ulp apart.
    longest_sum = 3 * 3 * 64
    want, got = _train_records(tmp_path / "eager"), _train_records(tmp_path / "compiled")
    assert [record["step"] for record in got] == [record["step"] for record in want]
    for expected, actual in zip(want, got, strict=True):
        assert math.isclose(actual["loss"], expected["loss"], rel_tol=longest_sum * 2**-24), actual["step"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_causal_lm_fine_tune_under_fsdp_equals_ddp(tmp_path):
    """The tiny Llama of ``examples/causal-lm-cpu.yaml``: its decoder layers sharded as the
    model's ``_no_split_modules`` names them, Hugging Face's own activation checkpointing,
    loss per labelled token across micro-batches and ranks; bit for bit, as above."""
    overrides = ("schedule.max_steps=8", "schedule.warmup_steps=2", "precision=fp32", "deterministic=true",
                 "monitor.report=false", "monitor.tensorboard=false", "checkpoint.enabled=false",
                 "activation_checkpointing.enabled=true", "accumulation.steps=2")
    logs = {}
    for strategy in ("ddp", "fsdp"):
        args = ["run", "examples/causal-lm-cpu.yaml", "--no-doctor", "--json", "--nproc", "2",
                "--set", f"run_dir={tmp_path / strategy}", "--set", f"distributed.strategy={strategy}"]
        for override in overrides:
            args += ["--set", override]
        result = run_cli(*args)
        assert result.returncode == 0, result.stderr[-4000:]
        logs[strategy] = result.stderr
    assert "block(s) of LlamaDecoderLayer sharded over 2 rank(s), then the root" in logs["fsdp"]
    assert _train_records(tmp_path / "fsdp") == _train_records(tmp_path / "ddp")
    _assert_same_weights(tmp_path / "fsdp", tmp_path / "ddp")
    assert summary(tmp_path / "fsdp")["eval_metrics"] == summary(tmp_path / "ddp")["eval_metrics"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("preset", ["examples/causal-lm-cpu.yaml", "examples/lora-tiny-cpu.yaml"])
def test_a_causal_lm_built_on_meta_and_loaded_by_shard_equals_ddp(tmp_path, preset):
    """A tiny Llama folder (``save_pretrained``): under FSDP the model is built on the meta
    device and each rank reads its rows of every tensor; DDP loads it whole with
    ``from_pretrained``. The rotary frequencies, which no checkpoint holds, are recomputed.
    With LoRA adapters (and the output head trained whole beside them) the frozen base
    loads by shard under PEFT's names, the head's trained copy from the head's weights,
    and the adapters are drawn from the run's seed once the base is in: the same
    starting model, so the same run, as DDP's whole build."""
    from skylift.recipes.tiny_lm import write_tiny_lm

    folder = write_tiny_lm(tmp_path / "tiny-llama")
    overrides = ("schedule.max_steps=6", "schedule.warmup_steps=2", "precision=fp32", "deterministic=true",
                 "monitor.report=false", "monitor.tensorboard=false", "checkpoint.enabled=false",
                 "accumulation.steps=2", f"recipe.model_path={folder}")
    logs = {}
    for strategy in ("ddp", "fsdp"):
        args = ["run", preset, "--no-doctor", "--json", "--nproc", "2",
                "--set", f"run_dir={tmp_path / strategy}", "--set", f"distributed.strategy={strategy}"]
        for override in overrides:
            args += ["--set", override]
        result = run_cli(*args)
        assert result.returncode == 0, result.stderr[-4000:]
        logs[strategy] = result.stderr
    assert "built on the meta device; this rank loaded its shards of" in logs["fsdp"]
    assert _train_records(tmp_path / "fsdp") == _train_records(tmp_path / "ddp")
    _assert_same_weights(tmp_path / "fsdp", tmp_path / "ddp")
