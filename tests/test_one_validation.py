"""plan, explore, train and verify read the same layout flags the same way: what one accepts the
others accept, what one refuses the others refuse for the same reason (one line, exit 2). Train and
verify stop where a rank would start; nothing is launched."""

from __future__ import annotations

import contextlib

import pytest

from fivefold.cli import main


class Started(BaseException):
    """Raised where a launch would begin: the command accepted its flags."""


def _started(*args, **kwargs):
    raise Started


COMMON = ["--model", "tiny", "--seq-len", "32", "--micro-batch", "2"]
# (layout flags on 4 ranks, None where every command runs them, else words of the one refusal)
CASES = [
    # neither --dp nor --fsdp: dp fills what tp leaves, in train and verify as in plan
    (["--tp", "2"], None),
    # an explicit --dp 1 is a degree, not a default to fill
    (["--dp", "1"], "must equal the world size 4"),
    # chunks of a pipeline need a pipeline
    (["--virtual-stages", "2"], "needs --pp > 1"),
    # --virtual-stages 2 without a schedule is the interleaved 1F1B everywhere
    (["--pp", "2", "--virtual-stages", "2", "--microbatches", "2"], None),
    # the model's positions bound a sequence in the planner too
    (["--seq-len", "1024"], "max_seq_len"),
    # sequence parallelism over a sequence tp does not divide: DTensor would pad every shard
    (["--tp", "2", "--sp", "--seq-len", "31"], "--sp shards each sequence"),
    # a split with a middle chunk of no layer: refused by verify before its ranks start, as by plan
    (
        ["--pp", "2", "--virtual-stages", "2", "--pp-split", "2,0,1,1", "--microbatches", "4"],
        "chunk 1 has 0 layers",
    ),
]


def _verdict(argv: list[str], capsys) -> tuple[str, str]:
    try:
        code = main(argv)
    except Started:
        code = "started"
    err = capsys.readouterr().err.strip()
    if code == 2:
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        return "refused", err
    assert code in (0, "started"), (argv, code, err)
    return "accepted", ""


@pytest.mark.parametrize(("flags", "refusal"), CASES, ids=[" ".join(f) for f, _ in CASES])
def test_every_command_reads_the_layout_flags_alike(flags, refusal, tmp_path, capsys, monkeypatch):
    import fivefold.parallel.spawn
    import fivefold.train.launch

    monkeypatch.setattr(fivefold.train.launch, "elastic_launch", _started)
    monkeypatch.setattr(fivefold.parallel.spawn, "spawn_ranks", _started)
    monkeypatch.chdir(tmp_path)
    argvs = {
        "plan": ["plan", *COMMON, "--hardware", "cpu", "--gpus", "4", *flags],
        "explore": ["explore", *COMMON, "--hardware", "cpu", "--gpus", "4", "--top", "0", "--no-lab"]
        + ["--out", str(tmp_path / "page.html"), *flags],
        "train": ["train", *COMMON, "--nproc", "4", "--steps", "1", "--run-dir", str(tmp_path / "run")]
        + flags,
        "verify": ["verify", *COMMON, "--nproc", "4", "--steps", "1", *flags],
    }
    verdicts = {name: _verdict(argv, capsys) for name, argv in argvs.items()}
    expected = "accepted" if refusal is None else "refused"
    assert {name: v[0] for name, v in verdicts.items()} == dict.fromkeys(argvs, expected)
    if refusal is not None:
        assert all(refusal in message for _, message in verdicts.values()), verdicts


REFUSED_BY_TRAIN = [
    # ZeRO-1 over tensor-parallel shards: Megatron runs it, torch's ZeroRedundancyOptimizer does not
    (["--tp", "2", "--dp", "2", "--zero", "1"], "--zero 1"),
    # HSDP with dp inside fsdp: torch slices FSDP's (dp, fsdp) mesh only in the world's own order
    (["--dp", "2", "--fsdp", "2", "--zero", "3", "--order", "dp,fsdp"], "--dp 2 with --fsdp 2 (HSDP)"),
    # ZeRO-2 over plain dp replicas: DeepSpeed shards there, fivefold's FSDP needs --fsdp
    (["--dp", "4", "--zero", "2"], "--zero 2 shards gradients with FSDP"),
    # a split backward re-runs full recompute's forwards and their tp collectives uncountably often
    (
        [
            "--tp",
            "2",
            "--pp",
            "2",
            "--pp-schedule",
            "zero-bubble",
            "--microbatches",
            "2",
            "--recompute",
            "full",
        ],
        "--pp-schedule zero-bubble with --recompute full",
    ),
]


@pytest.mark.parametrize(("layout", "why"), REFUSED_BY_TRAIN, ids=[w for _, w in REFUSED_BY_TRAIN])
def test_a_layout_only_other_frameworks_run_is_planned_with_a_note(
    layout, why, tmp_path, capsys, monkeypatch
):
    """plan and explore still predict a layout train refuses, and both say that train refuses it, and
    why; train and verify refuse it before any rank starts."""
    import fivefold.parallel.spawn
    import fivefold.train.launch

    monkeypatch.setattr(fivefold.train.launch, "elastic_launch", _started)  # no rank ever starts
    monkeypatch.setattr(fivefold.parallel.spawn, "spawn_ranks", _started)
    monkeypatch.chdir(tmp_path)
    flags = [*COMMON, "--hardware", "cpu", "--gpus", "4", *layout]
    for argv in (["plan", *flags], ["explore", *flags, "--top", "0", "--no-lab", "--out", "page.html"]):
        assert main(argv) == 0
        assert f"note: fivefold train refuses this layout: {why}" in capsys.readouterr().out
    assert f"your layout (fivefold train refuses it: {why}" in (tmp_path / "page.html").read_text()
    for argv in (
        ["train", *COMMON, "--nproc", "4", "--steps", "1", "--run-dir", str(tmp_path / "run"), *layout],
        ["verify", *COMMON, "--nproc", "4", "--steps", "1", *layout],
    ):
        verdict, message = _verdict(argv, capsys)
        assert verdict == "refused" and why in message, message


def test_the_assumed_batch_and_sequence_fit_the_flags_given(capsys) -> None:
    """Left out, the global batch is a whole number of --micro-batch per data rank, and the sequence
    no longer than the model's positions: a plan never refuses what it assumed itself."""
    assert main(["plan", "--model", "tiny", "--hardware", "cpu", "--gpus", "6", "--micro-batch", "4"]) == 0
    captured = capsys.readouterr()  # on a CPU device train's: 128 tokens, a micro-batch a data rank
    assert "--seq-len 128, --global-batch 24" in captured.err and "must be a multiple" not in captured.err
    assert main(["plan", "--model", "tiny", "--gpus", "6", "--micro-batch", "4"]) == 0
    assert "--seq-len 256" in capsys.readouterr().err  # elsewhere 4,096, or the model's positions
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--tp", "2", "--micro-batch", "3"]) == 0
    assert "--seq-len 4096" in capsys.readouterr().err


def test_plan_and_explore_name_the_train_flags_of_a_pipelines_batch_split(tmp_path, capsys) -> None:
    """A pipelined plan of 8 micro-batches of 2, where train would split the data rank's 16 sequences
    into its default 2 × pp = 6 (and refuse): both faces name the flags that run the planned split."""
    flags = [*COMMON[:2], "--hardware", "cpu", "--gpus", "6", "--tp", "2", "--pp", "3", "--seq-len", "48"]
    flags += ["--micro-batch", "2", "--global-batch", "16"]
    hint = "fivefold train runs this batch split with --micro-batch 2 --microbatches 8"
    out = tmp_path / "page.html"
    for argv in (["plan", *flags], ["explore", *flags, "--top", "0", "--no-lab", "--out", str(out)]):
        assert main(argv) == 0
        assert hint in capsys.readouterr().out


def test_a_cpu_plan_left_to_its_defaults_is_of_the_run_train_makes(tmp_path, capsys, monkeypatch) -> None:
    """On a CPU device, what plan is not told is what train is not told: the plan of the same layout
    flags has train's sequence, step batch and pipeline split (train's micro-batch is a pipelined data
    rank's batch, cut into 2 × pp micro-batches)."""
    import dataclasses
    import json

    import fivefold.train.launch
    from fivefold.plan import validation as V
    from fivefold.plan.runs import run_from_dir

    jobs = []

    def capture(config, entry):  # where the ranks would start: keep the job they would run
        def run(job, *_):
            jobs.append(job)
            raise Started

        return run

    monkeypatch.setattr(fivefold.train.launch, "elastic_launch", capture)
    monkeypatch.chdir(tmp_path)
    for i, flags in enumerate((["--fsdp", "2", "--tp", "2"], ["--pp", "2", "--dp", "2"])):
        with pytest.raises(Started):
            main(["train", "--model", "small", "--nproc", "4", "--steps", "1", "--run-dir", f"r{i}", *flags])
        config = jobs[-1].config
        data = config.layout.dp * config.layout.fsdp
        assert main(["plan", "--model", "small", "--hardware", "cpu", "--gpus", "4", *flags, "--json"]) == 0
        planned = json.loads(capsys.readouterr().out)
        assert planned["seq_len"] == config.train.seq_len
        assert planned["dtype"] == config.train.dtype and planned["kernels"] == "eager"  # not compiled
        assert planned["global_batch"] == config.train.step_batch(data)
        pipelined = config.layout.pp > 1
        split = config.layout.resolve(4).microbatches if pipelined else 1
        assert planned["micro_batch"] == config.train.micro_batch // split
        assert planned["microbatches"] == (split if pipelined else 1)
        # and the same step as the plan `--validate` makes of the run directory train writes
        run = tmp_path / f"run{i}"
        run.mkdir()
        # as the ranks write it: the layout resolved (dp filled, the pipeline's micro-batch count)
        written = dataclasses.replace(config, layout=config.layout.resolve(4))
        (run / "config.toml").write_text(written.to_toml())
        (run / "metrics.jsonl").write_text(
            '{"step": 1, "step_time_s": 1.0}\n{"step": 2, "step_time_s": 1.0}\n'
        )
        (run / "run.json").write_text(json.dumps({"world": 4, "mfu_peak_from": "cpu", "threads_per_rank": 1}))
        (case,) = V.cases([run_from_dir(run)])
        read_back = V._plan_case(case, case.inputs.hw)
        assert planned["step_time_s"] == pytest.approx(read_back.step_time_s, rel=1e-9)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--sp"], "note: --sp shards the activations tensor parallelism replicates; tp is 1 here"),
        (
            ["--tp", "2", "--pp-schedule", "gpipe"],
            "note: --pp-schedule orders a pipeline's micro-batches; pp is 1",
        ),
        (["--tp", "2", "--zero", "3"], "note: --zero shards the optimizer state"),
        (
            ["--tp", "2", "--microbatches", "2"],
            "note: --microbatches splits a pipeline's batch into micro-batches",
        ),
    ],
)
def test_a_flag_with_nothing_to_act_on_is_named_by_every_command(flags, said, tmp_path, capsys, monkeypatch):
    """A refining flag for an axis of size 1 (sp without tp, a schedule without pp, ZeRO without data
    ranks) leaves the layout valid but does nothing: plan, explore, train and verify each say so once."""
    import fivefold.parallel.spawn
    import fivefold.train.launch

    monkeypatch.setattr(fivefold.train.launch, "elastic_launch", _started)
    monkeypatch.setattr(fivefold.parallel.spawn, "spawn_ranks", _started)
    monkeypatch.chdir(tmp_path)
    argvs = (
        ["plan", *COMMON, "--hardware", "cpu", "--gpus", "2", *flags],
        ["explore", *COMMON, "--hardware", "cpu", "--gpus", "2", "--top", "0", "--no-lab", "--out", "p.html"]
        + flags,
        ["train", *COMMON, "--nproc", "2", "--steps", "1", "--run-dir", "run", *flags],
        ["verify", *COMMON, "--nproc", "2", "--steps", "1", *flags],
    )
    for argv in argvs:
        with contextlib.suppress(Started):  # train accepted its flags where its ranks would start
            assert main(argv) == 0
        err = capsys.readouterr().err
        assert err.count(said) == 1, (argv[0], err)
    # the same flags where their axis is there: no note
    for argv in (["plan", *COMMON, "--hardware", "cpu", "--gpus", "4", "--tp", "2", "--pp", "2", "--sp"],):
        assert main(argv) == 0
        assert "no effect" not in capsys.readouterr().err


def test_train_names_a_micro_batch_its_pipeline_does_not_take(tmp_path, capsys, monkeypatch) -> None:
    """pp 2 × dp 2 with --global-batch 16: each data rank's 8 sequences run as --microbatches 2 of 4,
    whatever --micro-batch says; a --micro-batch of 2 is named, with the count that would make it so."""
    import fivefold.train.launch

    monkeypatch.setattr(fivefold.train.launch, "elastic_launch", _started)
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--model", "tiny", "--seq-len", "32", "--nproc", "4", "--pp", "2", "--dp", "2"]
    argv += ["--global-batch", "16", "--microbatches", "2", "--steps", "1"]
    for micro, said in (("2", True), ("4", False)):
        with contextlib.suppress(Started):
            main([*argv, "--micro-batch", micro, "--run-dir", f"r{micro}"])
        err = capsys.readouterr().err
        note = "note: with pp 2, a data rank's 8 sequences run as --microbatches 2 of 4; --micro-batch 2"
        assert (note in err) is said, err
        assert ("give --microbatches 4 for micro-batches of 2" in err) is said
