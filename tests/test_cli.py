"""Bad input on every command: one line on stderr, exit code 2, no traceback; `--nproc 2` runs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fivefold.cli import main


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("inputs")
    (root / "bad.toml").write_text("[train\nsteps = 3\n")
    (root / "unknown_key.toml").write_text("[train]\nstepz = 3\n")
    (root / "big_tp.toml").write_text('model = "tiny"\n[layout]\ntp = 3\n')
    # 37,000B parameters: the run would die allocating them; refused before any tensor is made
    (root / "huge.toml").write_text(
        'name = "huge"\nlayers = 2\nhidden = 1048576\nheads = 8\nvocab = 1000000\n'
    )
    corpus = root / "code.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    hf = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    hf |= {"vocab_size": 256, "intermediate_size": 128, "rope_scaling": "yes"}
    (root / "rope_str.json").write_text(json.dumps(hf))
    (root / "no_config").mkdir()
    (root / "occupied").mkdir()
    (root / "occupied" / "metrics.jsonl").write_text("")
    return {
        "occupied": str(root / "occupied"),
        "rope_str": str(root / "rope_str.json"),
        "no_config": str(root / "no_config"),
        "bad": str(root / "bad.toml"),
        "unknown_key": str(root / "unknown_key.toml"),
        "big_tp": str(root / "big_tp.toml"),
        "huge": str(root / "huge.toml"),
        "missing": str(root / "missing.toml"),
        "corpus": str(corpus),
        "root": str(root),
    }


def _has(command: str) -> bool:
    return importlib.util.find_spec(f"fivefold.commands.{command}") is not None


# (command, argv after the command, words the message must contain); {placeholders} from `files`
BAD_INPUT = [
    ("train", ["--model", "no-such-model"], "unknown model"),
    ("train", ["--config", "{bad}"], "malformed TOML"),
    ("train", ["--config", "{missing}"], "not found"),
    ("train", ["--model", "{missing}"], "not found"),
    ("train", ["--config", "{unknown_key}"], "unknown key"),
    ("train", ["--config", "{big_tp}"], "world size"),
    ("train", ["--model", "tiny", "--tp", "3", "--nproc", "3"], "must divide"),
    ("train", ["--model", "tiny", "--dp", "3", "--nproc", "2"], "world size"),
    ("train", ["--model", "tiny", "--steps", "0"], "--steps must be positive"),
    ("train", ["--model", "tiny", "--global-batch", "12", "--micro-batch", "8"], "multiple of"),
    ("train", ["--model", "tiny", "--nproc", "0"], "--nproc"),
    ("train", ["--model", "tiny", "--data", "{root}/nothing-here", "--seq-len", "16"], "data not found"),
    ("train", ["--model", "tiny", "--tokenizer", "{root}/none.json"], "tokenizer not found"),
    ("train", ["--model", "tiny", "--resume"], "--run-dir"),
    ("train", ["--model", "{huge}", "--run-dir", "{root}/huge-run"], "Adam state take 16 bytes each"),
    (
        "train",
        ["--model", "tiny", "--run-dir", "{root}/fresh", "--resume", "--data", "{corpus}", "--seq-len", "16"],
        "no finished checkpoint",
    ),
    ("demo", ["--steps", "0"], "--steps must be positive"),
    # the demo has no --resume: it names the command that continues a run
    ("demo", ["--run-dir", "{occupied}"], "continue it with `fivefold train --resume --run-dir"),
    # a file where the run directory belongs: named before any rank starts, not as mkdir's errno
    ("demo", ["--run-dir", "{corpus}"], "exists and is not a directory"),
    ("train", ["--model", "tiny", "--nproc", "2", "--run-dir", "{corpus}"], "exists and is not a directory"),
    ("mesh", ["--gpus", "4", "--tp", "3"], "world size"),
    ("plan", ["--model", "no-such-model", "--hardware", "h100-80gb", "--gpus", "8"], "unknown model"),
    ("plan", ["--model", "llama3-8b", "--hardware", "no-such-gpu", "--gpus", "8"], "unknown hardware"),
    ("generate", ["--from", "{root}/no-run", "--prompt", "x"], "no-run"),
    ("generate", ["--from", "{corpus}", "--prompt", "x"], "a file, not a directory"),
    # flags that one process or --greedy would drop without a word
    ("generate", ["--model", "tiny", "--prompt", "x", "--comm"], "give --nproc 2 or more"),
    ("generate", ["--model", "tiny", "--prompt", "x", "--greedy", "--temperature", "0.5"], "--temperature"),
    ("generate", ["--model", "tiny", "--prompt", "x", "--greedy", "--top-k", "5"], "would not be used"),
    ("generate", ["--model", "tiny", "--prompt", "x", "--ids", "--json"], "give one of them"),
    ("plan", ["--validate", "/dev/null"], "not a regular file"),
    ("plan", ["--validate", "--plot", "{corpus}/x.svg"], "code.txt is a file, not a directory"),
    (
        "plan",
        ["--model", "llama3-8b", "--gpus", "8", "--mode", "inference", "--context", "10**9"],
        "positions",
    ),
    ("plan", ["--model", "llama3-8b", "--gpus", "8", "--global-batch", "10**29"], "at most 1,000,000,000"),
    ("plan", ["--model", "llama3-8b", "--gpus", "8", "--gpus-per-node", "10**29"], "at most 1,048,576"),
    ("mesh", ["--gpus", "16", "--gpus-per-node", "10**29"], "in 1..1,048,576"),
    ("train", ["--model", "tiny", "--micro-batch", "10**10"], "--micro-batch must be at most"),
    ("train", ["--model", "{no_config}"], "is a directory without a config.json"),
    ("train", ["--model", "{rope_str}"], "rope_scaling must be a JSON object"),
    # expert parallelism on a dense model is named as such first, not as a world to re-split
    ("train", ["--model", "tiny", "--ep", "2", "--nproc", "2"], "needs a mixture-of-experts model"),
    ("verify", ["--model", "tiny", "--ep", "2", "--nproc", "2"], "needs a mixture-of-experts model"),
    ("plan", ["--model", "llama3-8b", "--gpus", "8", "--ep", "2", "--search"], "needs a mixture-of-experts"),
    ("explore", ["--model", "llama3-8b", "--gpus", "8", "--ep", "2", "--out", "{root}/x.html"], "mixture-of"),
]


def _number(arg: str) -> str:
    """`10**29` in a case: the digits a user would type."""
    base, _, power = arg.partition("**")
    return str(int(base) ** int(power)) if power and base.isdigit() and power.isdigit() else arg


@pytest.mark.parametrize(("command", "argv", "words"), BAD_INPUT, ids=[f"{c}-{w}" for c, _, w in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_code_2(command, argv, words, files, capsys):
    if not _has(command):
        pytest.skip(f"fivefold {command} is not in this build")
    code = main([command] + [_number(a.format(**files)) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert words in lines[0]
    assert lines[0].startswith(f"fivefold {command}: error: ")


def _fivefold(*argv: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "fivefold", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_readmes_fsdp_by_tp_run_prints_no_warning(files, tmp_path):
    """`train --nproc 4 --fsdp 2 --tp 2` (the README's): torch's FSDP2 warned four times that the
    embedding returned a view, which in-place ops would break; the model adds out of place."""
    flags = ["--model", "tiny", "--steps", "1", "--seq-len", "32", "--data", files["corpus"], "--no-progress"]
    run = tmp_path / "run"
    proc = _fivefold(
        "train", *flags, "--nproc", "4", "--fsdp", "2", "--tp", "2", "--run-dir", str(run), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_nproc_2_starts_agrees_on_a_layout_and_exits_cleanly(files, tmp_path):
    common = [
        "--model",
        "tiny",
        "--steps",
        "3",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--data",
        files["corpus"],
        "--device",
        "cpu",
        "--no-progress",
    ]
    proc = _fivefold("train", *common, "--nproc", "2", "--run-dir", str(tmp_path / "two"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    two = tmp_path / "two"
    assert "dp = 2" in (two / "config.toml").read_text()  # no axis given: plain data parallel
    if not (two / "metrics.jsonl").exists():  # a build without the data-parallel runner
        assert "agreed on the layout" in proc.stderr
        assert "rank 0: dp=0" in proc.stdout and "rank 1: dp=1" in proc.stdout
        return
    assert "rank 1 step 3/3 loss" in proc.stderr  # every rank reports its loss
    # the reference: one process, the same global batch (2 micro-batches of 2), started by torchrun
    # through the module entry point
    one = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "1",
            "-m",
            "fivefold.train",
            *common,
            "--global-batch",
            "4",
            "--run-dir",
            str(tmp_path / "one"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert _losses(two) == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)


@pytest.mark.slow
def test_a_failing_rank_is_reported_once(files, tmp_path):
    # data that is there but malformed: found out by the ranks as they read it, not before
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"no text": 1}\n')
    proc = _fivefold(
        "train",
        "--model",
        "tiny",
        "--nproc",
        "2",
        "--device",
        "cpu",
        "--data",
        str(bad),
        "--run-dir",
        str(tmp_path / "r"),
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert '"text" field' in lines[0] and "rank" in lines[0]


REFUSED = ["--fsdp", "2", "--pp", "2", "--pp-schedule", "zero-bubble", "--zero", "3", "--microbatches", "2"]


@pytest.mark.parametrize(("flags", "axis"), [(REFUSED, "--pp-schedule zero-bubble")])
def test_unsupported_axis_combinations_are_refused_by_train(flags: list[str], axis: str, tmp_path) -> None:
    """A combination torch cannot run (a split backward with ZeRO-3's resharding): training says so
    and what to use instead, before any rank starts, rather than fail inside a step."""
    model = "tiny-moe" if "--ep" in flags else "tiny"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fivefold",
            "train",
            "--nproc",
            "4",
            "--model",
            model,
            "--steps",
            "1",
            "--run-dir",
            str(tmp_path / "run"),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert axis in done.stderr and "--zero 2" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()  # refused before any rank started


def test_a_full_disk_is_one_line_and_exit_code_1_in_any_command(tmp_path, monkeypatch, capsys):
    """Storage without room is the machine's fault, not the input's: one line naming the file, exit
    code 1, whichever command was writing."""
    import errno

    import fivefold.commands.explore as explore

    out = tmp_path / "page.html"

    def no_room(args):
        raise OSError(errno.ENOSPC, "No space left on device", str(out))

    monkeypatch.setattr(explore, "run", no_room)
    assert main(["explore", "--model", "tiny", "--gpus", "2", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fivefold explore: error: No space left on device: {out}"]


def test_an_output_the_storage_refuses_leaves_the_earlier_file_whole(tmp_path) -> None:
    """A picture or page written over an earlier one on a full disk (or past a file-size limit, or on
    storage gone read-only): the earlier file stays as it was, no temporary file is left, and the
    line is the machine's fault (exit code 1), not the input's."""
    import errno

    from fivefold.errors import StorageFault
    from fivefold.outputs import write_whole

    out = tmp_path / "report.png"
    out.write_bytes(b"the earlier picture")
    for code in (errno.ENOSPC, errno.EFBIG, errno.EROFS):

        def half_then_refused(target: Path, code: int = code) -> None:
            target.write_bytes(b"half a pict")
            raise OSError(code, os.strerror(code))

        with pytest.raises(StorageFault) as refused:
            write_whole(out, half_then_refused)
        assert refused.value.exit_code == 1 and os.strerror(code) in str(refused.value)
        assert out.read_bytes() == b"the earlier picture" and sorted(tmp_path.iterdir()) == [out]


def test_a_file_size_limit_ends_a_run_with_one_line_and_exit_code_1(tmp_path) -> None:
    """`ulimit -f` (EFBIG) is storage refusing a write, as a full disk is: the run that outgrows it
    ends with one line naming the file, exit code 1, no traceback."""
    import shlex

    run = tmp_path / "run"
    command = [sys.executable, "-m", "fivefold", "train", "--model", "tiny", "--steps", "40"]
    command += ["--seq-len", "32", "--checkpoint-every", "-1", "--run-dir", str(run), "--no-progress"]
    script = f"ulimit -f 4; exec {shlex.join(command)}"  # 4 KB: config.toml fits, the metrics do not
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "File too large" in done.stderr, done.stderr
    assert "metrics.jsonl" in done.stderr.strip().splitlines()[-1], done.stderr


def test_a_full_disk_under_the_metrics_log_names_the_file_whenever_it_surfaces(tmp_path):
    """A full disk can show at a line's flush or only when the file closes: either way the one line
    names metrics.jsonl, which a rank then reports without a traceback."""
    import errno

    from fivefold.errors import storage_fault
    from fivefold.train.metrics import MetricsLog

    class NoRoom:
        def __init__(self, at: str) -> None:
            self.at = at

        def write(self, text: str) -> int:
            return len(text)

        def flush(self) -> None:
            if self.at == "flush":
                raise OSError(errno.ENOSPC, "No space left on device")

        def close(self) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    for at in ("flush", "close"):
        log = MetricsLog(tmp_path, rank=0, world=1, total_steps=1, start_step=0, progress=False)
        log._fh.close()
        log._fh = NoRoom(at)
        rec = {"step": 1, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "tokens_per_s": 1.0}
        with pytest.raises(OSError) as failed:
            log.record(rec)
            log.close()
        assert storage_fault(failed.value) == f"No space left on device: {tmp_path / 'metrics.jsonl'}"
    assert storage_fault(ValueError("x")) is None
    assert storage_fault(OSError(errno.EACCES, "Permission denied")) is None
    assert (
        storage_fault(OSError(errno.ENOSPC, "No space left on device"), "run")
        == "No space left on device: run"
    )


@pytest.mark.parametrize(
    "argv",
    [["train", "--model", ""], ["plan", "--model", "", "--gpus", "8"], ["mesh", "--gpus", "8", "--svg", ""]],
)
def test_an_empty_value_is_refused_not_read_as_the_default(argv, capsys):
    """`--model "$MODEL"` with MODEL unset: training the default model would run what was not named."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    flag = argv[argv.index("") - 1]
    assert capsys.readouterr().err.startswith(f"fivefold {argv[0]}: error: {flag} is empty")


def test_presets_say_which_models_train_builds(capsys) -> None:
    """The preset list tells a planned-only model (latent attention) from one train builds, and its
    word is what train does with it."""
    assert main(["presets", "--json"]) == 0
    models = json.loads(capsys.readouterr().out)["models"]
    assert models["deepseek-v3"]["trainable"] is False and models["tiny-moe"]["trainable"] is True
    assert main(["presets"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("deepseek-v3"))
    assert line.endswith("plan only")
    assert main(["train", "--model", "deepseek-v3", "--steps", "1"]) == 2
    assert "latent attention" in capsys.readouterr().err
