"""Run directories are untrusted input: reading a checkpoint never runs code from it."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import socket
import warnings
from pathlib import Path

import pytest
import torch

from fivefold.cli import main
from fivefold.parallel.spawn import loopback_store, spawn_ranks
from fivefold.train.safe_metadata import SafeLoadPlanner, UnsafeMetadata, load_metadata


class _RunsCommand:
    """Pickles to a call of os.system: what a crafted checkpoint index would hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture()
def run_dir(tiny_run) -> Path:
    return tiny_run


def _one_line_exit_2(capsys, argv: list[str], words: str) -> None:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "weights_only" not in err and len(err.strip().splitlines()) == 1, err
    assert words in err, err


def test_the_real_index_reads_and_a_crafted_one_is_refused(run_dir, tmp_path):
    real = (run_dir / "checkpoints" / "step_1" / ".metadata").read_bytes()
    stored = load_metadata(real).state_dict_metadata
    assert any(key.startswith("model.") for key in stored) and any(key.startswith("optim.") for key in stored)
    marker = tmp_path / "ran"
    with pytest.raises(UnsafeMetadata, match="posix.system|os.system"):
        load_metadata(pickle.dumps(_RunsCommand(marker)))
    assert not marker.exists()


@pytest.mark.parametrize("command", ["resume", "generate"])
def test_a_crafted_checkpoint_index_does_not_run(run_dir, tmp_path, capsys, command):
    run = tmp_path / "copy"
    shutil.copytree(run_dir, run)
    marker = tmp_path / "ran"
    (run / "checkpoints" / "step_1" / ".metadata").write_bytes(pickle.dumps(_RunsCommand(marker)))
    argv = _reading(command, run)
    _one_line_exit_2(capsys, argv, "refused")
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("command", ["resume", "generate"])
def test_a_crafted_checkpoint_index_does_not_run_in_the_ranks(run_dir, tmp_path, capfd, monkeypatch, command):
    """The ranks read the index themselves: with the launcher's own check out of the way, each
    rank must refuse it too (one line, exit code 2), and no rank runs what it holds."""
    import fivefold.commands.train
    import fivefold.train.checkpoint

    for name in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME"):  # the launcher sets them for its ranks
        monkeypatch.setenv(name, os.environ.get(name, "1" if name == "OMP_NUM_THREADS" else "lo"))
    run = tmp_path / "copy"
    shutil.copytree(run_dir, run)
    marker = tmp_path / "ran"
    (run / "checkpoints" / "step_1" / ".metadata").write_bytes(pickle.dumps(_RunsCommand(marker)))
    spawned: list[int] = []
    if command == "resume":
        monkeypatch.setattr(fivefold.commands.train, "preflight", lambda *args, **kwargs: None)
        argv = ["train", "--run-dir", str(run), "--resume", "--steps", "2", "--no-progress", "--nproc", "2"]
        argv += ["--global-batch", "4", "--watchdog", "60"]
    else:
        import fivefold.parallel.spawn

        real_find, real_spawn = fivefold.train.checkpoint.find_checkpoint, fivefold.parallel.spawn.spawn_ranks

        def launcher_check(path, step=None, **kwargs):  # as if it had read the untouched index
            return real_find(run_dir, step, **kwargs)

        def spawn(*args, **kwargs):
            spawned.append(1)
            return real_spawn(*args, **kwargs)

        monkeypatch.setattr(fivefold.train.checkpoint, "find_checkpoint", launcher_check)
        monkeypatch.setattr(fivefold.parallel.spawn, "spawn_ranks", spawn)
        argv = ["generate", "--from", str(run), "--prompt", "x", "--max-new-tokens", "2", "--nproc", "2"]
        argv += ["--tp", "2"]
    capfd.readouterr()
    code = main(argv)
    err = capfd.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err and "weights_only" not in err, err
    assert "refused" in lines[0] and "posix.system" in lines[0], err
    if command == "resume":
        assert lines[0].startswith("fivefold train: error: rank "), err  # said by a rank, not before
    else:
        assert spawned == [1]  # the ranks started and refused it themselves
    assert not marker.exists()


def test_a_crafted_or_damaged_rng_file_is_one_line(run_dir, tmp_path, capsys):
    run = tmp_path / "copy"
    shutil.copytree(run_dir, run)
    marker = tmp_path / "ran"
    rng = run / "checkpoints" / "step_1" / "rng_rank0.pt"
    argv = ["train", "--run-dir", str(run), "--resume", "--steps", "2", "--no-progress"]
    crafted = io.BytesIO()
    torch.save({"cpu": _RunsCommand(marker)}, crafted)
    for data in (crafted.getvalue(), b"not a torch file"):
        rng.write_bytes(data)
        _one_line_exit_2(capsys, argv, "incomplete (shard rng_rank0.pt is")  # not the size it was written at
        _record_size(rng)  # the same file, as if written so: the loader itself must refuse it
        _one_line_exit_2(capsys, argv, "RNG state")
        assert not marker.exists()
    # a bare pickle: torch warns about its protocol, which must not reach the user as more lines
    rng.write_bytes(pickle.dumps(_RunsCommand(marker)))
    _record_size(rng)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # as a fresh process shows it, not once per test session
        _one_line_exit_2(capsys, argv, "RNG state")
    assert not [w for w in caught if "pickle protocol" in str(w.message)]
    assert not marker.exists()


@pytest.mark.parametrize("command", ["resume", "generate"])
def test_a_shard_that_is_not_tensors_is_named_without_torchs_advice(run_dir, tmp_path, capsys, command):
    """A weight shard of other bytes, its size and checksum recorded as if written so: torch's refusal
    ends in a pointer to its docs (and advises weights_only=False); the user is told what is wrong."""
    run = tmp_path / "copy"
    shutil.copytree(run_dir, run)
    marker = tmp_path / "ran"
    shard = next((run / "checkpoints" / "step_1").glob("*.distcp"))
    crafted = pickle.dumps(_RunsCommand(marker))
    shard.write_bytes(crafted * (shard.stat().st_size // len(crafted) + 1))
    _record_size(shard)
    argv = _reading(command, run)
    _one_line_exit_2(capsys, argv, "a shard does not read as tensors alone")
    assert not marker.exists()


def _reading(command: str, run: Path) -> list[str]:
    """The command line that reads `run`'s checkpoint: a resumed train, or generate from it."""
    if command == "resume":
        return ["train", "--run-dir", str(run), "--resume", "--steps", "2", "--no-progress"]
    return ["generate", "--from", str(run), "--prompt", "x", "--max-new-tokens", "2"]


def _record_size(file: Path) -> None:
    """Make the manifests agree with the file, as whoever crafted the directory could."""
    import zlib

    manifest = file.parent / "shards.json"
    shards = json.loads(manifest.read_text())
    shards["0"][file.name] = file.stat().st_size
    manifest.write_text(json.dumps(shards))
    sums = file.parent / "checksums.json"
    sums.write_text(
        json.dumps(dict(json.loads(sums.read_text()), **{file.name: zlib.crc32(file.read_bytes())}))
    )


def test_non_tensor_checkpoint_values_are_not_unpickled_freely(tmp_path):
    marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save(_RunsCommand(marker), buffer)
    buffer.seek(0)
    planner = SafeLoadPlanner()
    planner.flatten_state_dict = False
    planner.state_dict = {}
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(None, buffer)
    assert not marker.exists()


def _external_address() -> str | None:
    """This machine's address on its default route, if it has one (nothing is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("8.8.8.8", 9))
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def _store_reachability(rank: int, world: int, external: str | None) -> tuple[str, bool, bool | None]:
    port = int(os.environ["MASTER_PORT"])
    outside = _reachable(external, port) if external else None
    return os.environ["MASTER_ADDR"], _reachable("127.0.0.1", port), outside


def test_the_local_rendezvous_store_listens_on_loopback_only():
    external = _external_address()
    with loopback_store() as store:
        assert _reachable("127.0.0.1", store.port)
        if external:
            assert not _reachable(external, store.port)
    # and the launcher's ranks meet on it: the address they are given, and what answers there
    for address, inside, outside in spawn_ranks(_store_reachability, 2, external):
        assert address == "127.0.0.1" and inside
        assert outside is (False if external else None)


@pytest.mark.parametrize("name", ["config.toml", "trace.json"])
def test_a_users_files_are_not_overwritten_by_a_new_run(tmp_path, capsys, corpus, name):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / name).write_text("# my own notes\n")
    for nproc in ("1", "2"):  # refused in this process, before any rank would start
        argv = ["train", "--model", "tiny", "--steps", "1", "--data", corpus, "--device", "cpu"]
        _one_line_exit_2(capsys, argv + ["--nproc", nproc, "--run-dir", str(mine)], "would overwrite")
    assert (mine / name).read_text() == "# my own notes\n"


# a run directory's other files, damaged or edited by hand: `report` reads them all
DAMAGED_FILES = [
    ("metrics.jsonl", b"\xff\xfe not text\n", "cannot read"),
    ("metrics.jsonl", b"[1, 2]\n", "numeric step and loss"),
    ("metrics.jsonl", b'{"step": 1, "loss": {"a": 1}}\n', "numeric step and loss"),
    ("metrics.jsonl", b'{"step": 1, "loss": null}\n', "numeric step and loss"),
    ("metrics.jsonl", b'{"step": 1, "lo\n{"step": 2, "loss": 2.5}\n', "line 1 is not JSON"),
    ("ledger.json", b"[1, 2]", "by_axis"),
    ("ledger.json", b'{"by_axis": {"tp": "x"}}', "numeric count and bytes"),
    ("trace.json", b'{"traceEvents": 5}', "list of trace events"),
    ("trace.json", b'[{"cat": "pipeline", "ph": "X", "args": 5}]', "pipeline event 0"),
    # JSON's NaN reads as a float: a busy time of "nan ms" beside an idle fraction of 0 was printed
    (
        "trace.json",
        b'[{"cat": "pipeline", "ph": "X", "name": "F0", "pid": 0, "ts": 0, "dur": NaN, '
        b'"args": {"kind": "F", "step": 1}}]',
        "finite pid, ts and dur",
    ),
    ("ledger.json", b'{"by_axis": {"tp": {"count": Infinity, "bytes": 8}}}', "numeric count and bytes"),
]


@pytest.mark.parametrize(("name", "data", "words"), DAMAGED_FILES)
def test_report_on_damaged_run_files_is_one_line(run_dir, tmp_path, capsys, name, data, words):
    from fivefold.measure.timeline import CATEGORY

    run = tmp_path / "copy"
    shutil.copytree(run_dir, run)
    (run / name).write_bytes(data.replace(b'"pipeline"', json.dumps(CATEGORY).encode()))
    _one_line_exit_2(capsys, ["report", str(run), "--out", str(tmp_path / "r.svg")], words)
    assert not (tmp_path / "r.svg").exists()


def test_a_half_written_last_metrics_line_is_skipped_as_explore_skips_it(run_dir, tmp_path, capsys):
    """A run killed mid-write, or one still writing, ends its metrics.jsonl in half a line: report and
    explore read the steps before it, as `plan --validate RUN_DIR` does."""
    from fivefold.cli import main

    run = tmp_path / "copy"
    shutil.copytree(run_dir, run)
    whole = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(whole + '{"step": 99, "lo')
    assert main(["report", str(run), "--out", str(tmp_path / "r.svg")]) == 0
    assert (
        main(["explore", "--run", str(run), "--top", "0", "--no-lab", "--out", str(tmp_path / "p.html")]) == 0
    )
    assert (tmp_path / "r.svg").exists() and (tmp_path / "p.html").exists()
    capsys.readouterr()


def test_report_on_a_directory_where_metrics_belong(run_dir, tmp_path, capsys):
    run = tmp_path / "copy"
    shutil.copytree(run_dir, run)
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()
    _one_line_exit_2(capsys, ["report", str(run), "--out", str(tmp_path / "r.svg")], "cannot read")


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        ("metrics_not_text", "cannot read"),
        ("metrics_dir", "is not a file"),
        ("loss_png_dir", "is not a file"),  # found before the steps run, not when the plot is drawn
        ("no_config", "is missing"),  # else the default model is built and its checkpoint blamed
        ("config_without_model", "has no [model] table"),
    ],
)
def test_resume_refuses_a_damaged_run_directory_before_training(
    run_dir, tmp_path, capsys, monkeypatch, damage, words
):
    import fivefold.train.loop

    run = tmp_path / "copy"
    shutil.copytree(run_dir, run)
    if damage == "metrics_not_text":
        (run / "metrics.jsonl").write_bytes(b"\xff\xfe\x00")
    elif damage in ("metrics_dir", "loss_png_dir"):
        name = "metrics.jsonl" if damage == "metrics_dir" else "loss.png"
        if (run / name).exists():
            (run / name).unlink()
        (run / name).mkdir()
    elif damage == "no_config":
        (run / "config.toml").unlink()
    else:
        text = (run / "config.toml").read_text()
        (run / "config.toml").write_text(text[text.index("[train]") :])
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.is_file()}
    started = []
    real = fivefold.train.loop.build_runner
    monkeypatch.setattr(
        fivefold.train.loop, "build_runner", lambda *a, **k: started.append(1) or real(*a, **k)
    )
    argv = ["train", "--run-dir", str(run), "--resume", "--steps", "2", "--no-progress"]
    _one_line_exit_2(capsys, argv, words)
    assert not started
    assert before == {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.is_file()}


@pytest.mark.parametrize(
    ("old", "new", "words"),
    [
        ("hidden = 32", "hidden = 64", "does not describe this checkpoint"),
        ("vocab = 256", "vocab = 1000000000", "weights take"),  # refused, not allocated
        # every weight keeps its shape: without the recorded model it loaded and sampled wrongly
        ("tie_embeddings = false", "tie_embeddings = true", "tie_embeddings = false, but"),
        ("rope_theta = 10000.0", "rope_theta = 500000.0", "rope_theta = 10000.0, but"),
    ],
)
def test_generate_from_a_hand_edited_config(run_dir, tmp_path, capsys, old, new, words):
    run = tmp_path / "copy"
    shutil.copytree(run_dir, run)
    text = (run / "config.toml").read_text()
    assert old in text
    (run / "config.toml").write_text(text.replace(old, new, 1))
    _one_line_exit_2(
        capsys, ["generate", "--from", str(run), "--prompt", "x", "--max-new-tokens", "2"], words
    )


def test_generate_on_ranks_refuses_a_hand_edited_model_before_they_start(run_dir, tmp_path, capsys):
    """`generate --nproc 2` reads the checkpoint in each rank: a config.toml that no longer describes it
    is named before any rank starts."""
    run = tmp_path / "copy"
    shutil.copytree(run_dir, run)
    text = (run / "config.toml").read_text()
    (run / "config.toml").write_text(text.replace("tie_embeddings = false", "tie_embeddings = true", 1))
    argv = [
        "generate",
        "--from",
        str(run),
        "--prompt",
        "x",
        "--max-new-tokens",
        "2",
        "--nproc",
        "2",
        "--tp",
        "2",
    ]
    _one_line_exit_2(capsys, argv, "tie_embeddings = false, but")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("hidden = 32", "hidden = 64"),
        # the same shapes: an untied checkpoint resumed tied dropped its head quietly, and the
        # other way round was called corrupt
        ("tie_embeddings = false", "tie_embeddings = true"),
        ("norm_eps = 1e-05", "norm_eps = 1e-06"),
    ],
)
def test_resume_with_a_hand_edited_model_names_config_toml(run_dir, tmp_path, capsys, old, new):
    """A config.toml whose model no longer matches the checkpoint is named as the cause, not the
    checkpoint called corrupt; nothing is written."""
    run = tmp_path / "copy"
    shutil.copytree(run_dir, run)
    text = (run / "config.toml").read_text()
    assert old in text
    (run / "config.toml").write_text(text.replace(old, new, 1))
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.is_file()}
    argv = ["train", "--run-dir", str(run), "--resume", "--steps", "99", "--no-progress"]
    _one_line_exit_2(capsys, argv, "does not describe this checkpoint")
    after = {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.is_file()}
    assert before == after, {k for k in after if before.get(k) != after[k]}


def test_a_resume_with_nothing_left_to_train_leaves_the_run_alone(run_dir, tmp_path, capsys):
    """--steps at or below the checkpoint's step: one line before anything starts, and the run's
    config, ledger and trace as they were (they used to be rewritten empty, with exit code 0)."""
    run = tmp_path / "copy"
    shutil.copytree(run_dir, run)
    before = {name: (run / name).read_bytes() for name in ("config.toml", "ledger.json", "trace.json")}
    argv = ["train", "--run-dir", str(run), "--resume", "--steps", "1", "--no-progress"]
    _one_line_exit_2(capsys, argv, "the checkpoint is at step 1, at or past --steps 1: nothing to train")
    assert {name: (run / name).read_bytes() for name in before} == before


@pytest.mark.parametrize(
    ("name", "text", "why"),
    [
        ("trainer.json", '{"step": -5}', "is not a step count"),
        ("trainer.json", '{"step": 4.5}', "is not a step count"),
        ("trainer.json", '{"step": true}', "is not a step count"),
        ("shards.json", '{"0": {"__0_0.distcp": 1e400}}', "shards.json is unreadable"),
        ("shards.json", '{"0": {"__0_0.distcp": -1}}', "shards.json is unreadable"),
    ],
)
def test_a_checkpoint_with_impossible_bookkeeping_is_not_whole(run_dir, tmp_path, capsys, name, text, why):
    """A step that is no count, or a shard size that is no size, makes the checkpoint incomplete: one
    line naming it (it used to be an OverflowError, or a rank's ValueError, or a silent truncation)."""
    run = tmp_path / "copy"
    shutil.copytree(run_dir, run)
    (run / "checkpoints" / "step_1" / name).write_text(text)
    argv = ["train", "--run-dir", str(run), "--resume", "--steps", "3", "--no-progress"]
    _one_line_exit_2(capsys, argv, why)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    ("name", "text", "argv", "words"),
    [
        # numbers Python will not convert (over 4,300 digits) and nesting deeper than its recursion
        ("hw.toml", "peak_tflops = 1" + "0" * 5000 + "\n", ["plan", "--hardware"], "TOML"),
        ("hw.toml", "x = " + _deep(100_000) + "\n", ["plan", "--hardware"], "TOML"),
        ("runs.toml", "x = " + _deep(100_000) + "\n", ["plan", "--validate"], "not valid TOML"),
        ("config.json", '{"hidden_size": 1' + "0" * 5000 + "}", ["plan", "--gpus", "8", "--model"], "JSON"),
        ("config.json", _deep(100_000), ["plan", "--gpus", "8", "--model"], "JSON"),
        # finite values far past any device or model: they overflowed the planner's arithmetic
        ("hw.toml", 'name = "x"\ngpu_memory_gb = 1e300\npeak_tflops = 9', ["plan", "--hardware"], "at most"),
        (
            "m.toml",
            "[model]\nlayers = 2\nhidden = 1e300\nheads = 4\nvocab = 256\n",
            ["plan", "--gpus", "8", "--model"],
            "hidden must be at most",
        ),
        # a runs file's counts: inf, or a batch of tokens under one sequence
        (
            "runs.toml",
            '[[run]]\nid = "r"\nsource = "s"\nkind = "measured"\n[run.hardware]\ngpu = "H100"\n'
            "[run.model]\nlayers = inf\nhidden = 4096\nheads = 32\nseq_len = 8192\n"
            "[run.layout]\ngpus = 8\n[run.measured]\nmfu = 0.4\n",
            ["plan", "--validate"],
            "model.layers must be an integer",
        ),
    ],
)
def test_files_past_pythons_limits_are_one_line(tmp_path, capsys, name, text, argv, words):
    path = tmp_path / name
    path.write_text(text)
    full = [*argv, str(path)] + (["--gpus", "8", "--model", "tiny"] if "--hardware" in argv else [])
    _one_line_exit_2(capsys, full, words)


def test_a_stale_torchrun_environment_is_one_line(tmp_path, capsys, monkeypatch):
    """LOCAL_RANK and WORLD_SIZE left over without RANK (or a RANK that is no number) made train take
    itself for a rank of a torchrun job and fail in the rendezvous with a traceback."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["train", "--model", "tiny", "--nproc", "2", "--steps", "1", "--run-dir", str(tmp_path / "run")]
    _one_line_exit_2(capsys, argv, "unset them to start the ranks with --nproc")


def test_a_pipeline_trace_without_a_rank_s_step_window_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    event = {"name": "F0", "ph": "X", "cat": "pipeline", "pid": 1, "ts": 0, "dur": 5}
    event["args"] = {"kind": "F", "step": 0}
    window = {**event, "name": "step", "pid": 0, "args": {"kind": "step", "step": 0}}
    (run / "trace.json").write_text(json.dumps({"traceEvents": [window, {**event, "pid": 0}, event]}))
    _one_line_exit_2(capsys, ["report", str(run)], "rank 1 has events of step 0 but no step window")


def test_resume_names_an_edited_model_before_the_tokenizer_it_no_longer_fits(run_dir, tmp_path, capsys):
    """A vocab cut to 10 in config.toml: the resume names the edit against the checkpoint, not the
    byte tokenizer's 256 tokens that the edited model would no longer hold."""
    run = tmp_path / "copy"
    shutil.copytree(run_dir, run)
    text = (run / "config.toml").read_text()
    (run / "config.toml").write_text(text.replace("vocab = 256", "vocab = 10", 1))
    argv = ["train", "--run-dir", str(run), "--resume", "--steps", "5", "--no-progress"]
    _one_line_exit_2(capsys, argv, "was saved for a model with vocab = 256")


def test_an_output_path_is_written_through_never_replaced(tmp_path, capsys):
    """`--out`/`--svg`/`--plot` write a file whole; a link keeps being a link (its file is written),
    a device or a FIFO is written into as a shell's `>` does (/dev/null stays a device), and a
    directory or a full device is one line, exit 2."""
    import stat
    import threading

    from fivefold.cli import main

    argv = ["mesh", "--gpus", "8", "--tp", "2", "--svg"]
    real, link = tmp_path / "real.svg", tmp_path / "link.svg"
    link.symlink_to(real)
    assert main([*argv, str(link)]) == 0
    assert link.is_symlink() and real.read_text().startswith("<svg")
    dangling = tmp_path / "dangling.svg"
    dangling.symlink_to(tmp_path / "made" / "here.svg")
    assert main([*argv, str(dangling)]) == 0
    assert dangling.is_symlink() and (tmp_path / "made" / "here.svg").read_text().startswith("<svg")
    assert main([*argv, "/dev/null"]) == 0
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    fifo = tmp_path / "picture.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    assert main([*argv, str(fifo)]) == 0
    reader.join(timeout=30)
    assert got and got[0].startswith(b"<svg") and stat.S_ISFIFO(os.stat(fifo).st_mode)
    capsys.readouterr()
    folder = tmp_path / "pictures.svg"  # a directory, whatever its name says
    folder.mkdir()
    assert main([*argv, str(folder)]) == 2
    err = capsys.readouterr().err
    assert "is a directory" in err and len(err.strip().splitlines()) == 1, err
    if os.path.exists("/dev/full"):  # storage without room: the machine's fault, exit code 1
        assert main([*argv, "/dev/full"]) == 1
        err = capsys.readouterr().err
        assert "No space left on device" in err and stat.S_ISCHR(os.stat("/dev/full").st_mode), err
