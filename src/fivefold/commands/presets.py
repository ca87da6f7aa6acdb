"""`fivefold presets`: the model and hardware presets, with their sizes."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")


def run(args: argparse.Namespace) -> int:
    import json

    from fivefold.config import check_buildable, load_hardware, load_model, preset_names, to_dict
    from fivefold.errors import FivefoldError
    from fivefold.plan.text import count_words

    models = {n: load_model(n) for n in preset_names("models")}
    hardware = {n: load_hardware(n) for n in preset_names("hardware")}

    def builds(model) -> bool:  # noqa: ANN001 - ModelSpec
        """Whether train, verify and generate build it (else it is planned only: latent attention)."""
        try:
            check_buildable(model)
        except FivefoldError:
            return False
        return True

    if args.json:
        print(
            json.dumps(
                {
                    "models": {
                        n: to_dict(m)
                        | {
                            "params": m.num_params(),
                            "active_params": m.num_params(active=True),
                            "trainable": builds(m),
                        }
                        for n, m in models.items()
                    },
                    "hardware": {n: to_dict(h) for n, h in hardware.items()},
                }
            )
        )
        return 0
    print(
        f"{'model':<16}{'layers':>7}{'hidden':>8}{'heads':>7}{'kv':>5}{'experts':>9}{'params':>12}{'active':>12}"
        "  train"
    )
    for n, m in models.items():
        experts = f"{m.experts}/{m.experts_per_token}" if m.is_moe else "-"
        print(
            f"{n:<16}{m.layers:>7}{m.hidden:>8}{m.heads:>7}{m.kv_heads:>5}{experts:>9}"
            f"{count_words(m.num_params()):>12}{count_words(m.num_params(active=True)):>12}"
            f"  {'yes' if builds(m) else 'plan only'}"
        )
    print("(train: yes where train, verify and generate build the model; plan only where they refuse it)")
    print()
    print(
        f"{'hardware':<12}{'memory GB':>10}{'bf16 TFLOP/s':>14}{'GPUs/node':>11}"
        f"{'intra GB/s':>12}{'inter GB/s':>12}"
    )
    for n, h in hardware.items():
        print(
            f"{n:<12}{h.gpu_memory_gb:>10g}{h.peak_tflops:>14g}{h.gpus_per_node:>11}"
            f"{h.intra_node_gbps:>12g}{h.inter_node_gbps:>12g}"
        )
    return 0
