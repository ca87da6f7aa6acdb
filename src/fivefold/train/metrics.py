"""Per-step metrics: `metrics.jsonl` (rank 0), a progress bar (rank 0) and per-rank log lines.

MFU = tokens/s × model FLOPs per token / (ranks × peak FLOP/s per rank), with model FLOPs from
`fivefold.flops.model_flops_per_token` (6 × matmul weights a token multiplies + attention scores,
full square, no recompute) and the peak of the hardware preset the device matches: the `cpu`
preset (an order-of-magnitude figure) on CPU; on GPU the preset named by the device
(A100/H100/H200/B200, else H100) with its vendor-published dense bf16 peak.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fivefold.config import ModelSpec, load_hardware
from fivefold.config.hardware import preset_for_gpu_name
from fivefold.flops import model_flops_per_token


def hardware_preset_for(device: torch.device) -> str:
    """The preset whose peak a run's MFU is counted against: its GPU's (the table the runs reader
    uses), an H100's for a CUDA device without one."""
    if device.type != "cuda":
        return "cpu"
    return preset_for_gpu_name(torch.cuda.get_device_name(device)) or "h100-80gb"


class MfuMeter:
    """Turns step time into tokens/s and MFU for one run."""

    def __init__(self, spec: ModelSpec, seq_len: int, world: int, device: torch.device) -> None:
        self.hardware = hardware_preset_for(device)
        # a CPU rank computes on its threads' cores: its peak is theirs (as the planner counts it)
        cores = torch.get_num_threads() if device.type == "cpu" else 1
        self.peak_flops = load_hardware(self.hardware).peak_tflops * 1e12 * cores
        self.flops_per_token = model_flops_per_token(spec, seq_len)
        self.world = world

    def __call__(self, tokens: int, seconds: float) -> tuple[float, float]:
        tokens_per_s = tokens / max(seconds, 1e-9)
        return tokens_per_s, tokens_per_s * self.flops_per_token / (self.world * self.peak_flops)


class MetricsLog:
    """Writes one JSON object per optimizer step and shows progress."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        world: int,
        total_steps: int,
        start_step: int,
        progress: bool = True,
        log_every: int = 10,
    ) -> None:
        self.rank, self.world, self.log_every, self.total = rank, world, log_every, total_steps
        self.path = run_dir / "metrics.jsonl"
        self._fh = None
        if rank == 0:
            _truncate_after(self.path, start_step)  # a resumed run rewrites the steps it repeats
            self._fh = self.path.open("a")
        self._bar = None
        if rank == 0 and progress:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
                desc="train",
            )

    def record(self, rec: dict[str, Any]) -> None:
        if self._fh is not None:
            with self._naming_the_file():
                self._fh.write(json.dumps(rec) + "\n")
                self._fh.flush()
        step = rec["step"]
        if self._bar is not None:
            post = {"loss": f"{rec['loss']:.3f}", "tok/s": f"{rec['tokens_per_s']:.0f}"}
            if rec.get("held_out_loss") is not None:
                post["held-out"] = f"{rec['held_out_loss']:.3f}"
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(1)
        # every rank reports its loss (the same global value) so a stalled or diverging rank shows
        if (self._bar is None or self.world > 1) and (step % self.log_every == 0 or step == self.total):
            line = (
                f"rank {self.rank} step {step}/{self.total} loss {rec['loss']:.4f} "
                f"lr {rec['lr']:.2e} grad_norm {rec['grad_norm']:.3f} tok/s {rec['tokens_per_s']:.0f}"
            )
            if rec.get("held_out_loss") is not None:
                line += f" held-out {rec['held_out_loss']:.4f}"
            self.note(line, every_rank=True)

    def note(self, text: str, every_rank: bool = False) -> None:
        if self.rank != 0 and not every_rank:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            # one write per line: ranks share the terminal, and print() writes the text and its
            # newline separately, which lets another rank's line land between them
            sys.stderr.write(text + "\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._fh is not None:
            fh, self._fh = self._fh, None
            with self._naming_the_file():
                fh.close()

    @contextlib.contextmanager
    def _naming_the_file(self) -> Iterator[None]:
        """A full disk can surface at a flush or only at the close: either way, name the file."""
        try:
            yield
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None


def _truncate_after(path: Path, step: int) -> None:
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            if record["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):  # a line half-written when the run was killed
            continue
    path.write_text("".join(line + "\n" for line in keep))
