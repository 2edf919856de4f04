"""What a run shows while it trains: the progress bar (or log lines where there is no terminal),
throughput and MFU over the steps since the last report, and the metrics log."""

from __future__ import annotations

import time

from shardflow.train import metrics as metrics_lib


class Progress:
    """The bar, the metrics log and the throughput window of a run from step ``start``."""

    def __init__(self, run, out, start: int, *, progress: bool, main_process: bool):
        import jax
        from tqdm import tqdm

        cfg = run.cfg
        self.run, self.schedule = run, run.schedule
        self.tokens_per_step = cfg.batch_size * cfg.data.seq_len
        self.flops_per_token = metrics_lib.flops_per_token(run.model_cfg, run.n_params, cfg.data.seq_len)
        self.peak = metrics_lib.peak_flops(jax.devices()[0], cfg.peak_flops)
        self.log = metrics_lib.MetricsLog(out, start, enabled=main_process)
        # tqdm shows no bar where its stream is not a terminal; log lines take its place there.
        self.bar = tqdm(
            total=cfg.steps,
            initial=start,
            disable=None if progress and main_process else True,
            dynamic_ncols=True,
            unit="step",
        )
        self.log_lines = progress and main_process and self.bar.disable
        self.window_start, self.window_steps = None, 0

    def stepped(self, metrics) -> None:
        """One more step dispatched; the first compiles, so throughput is timed from its end."""
        import jax

        if self.window_start is None:
            jax.block_until_ready(metrics)
            self.window_start, self.window_steps = time.perf_counter(), 0
        else:
            self.window_steps += 1
        self.bar.update(1)

    def report(self, done: int, step: int, metrics, val_loss) -> None:
        """Log step ``done``'s metrics (``val_loss()`` where given and the loss is finite) and
        start a new throughput window."""
        import math

        import jax

        jax.block_until_ready(metrics)
        elapsed = time.perf_counter() - self.window_start
        tok_s = self.window_steps * self.tokens_per_step / elapsed if self.window_steps else None
        mfu = tok_s * self.flops_per_token / (self.peak * jax.device_count()) if tok_s and self.peak else None
        loss = float(metrics["loss"])
        val = val_loss() if val_loss is not None and math.isfinite(loss) else None
        self.log.log(
            done,
            loss=loss,
            grad_norm=float(metrics["grad_norm"]),
            lr=float(self.schedule(step)),
            tokens_per_s=tok_s,
            mfu=mfu,
            val_loss=val,
            **metrics_lib.routing_scalars(metrics),
        )
        shown = {
            "loss": f"{loss:.3f}",
            "tok_s": f"{tok_s:,.0f}" if tok_s else "-",
            "mfu": f"{100 * mfu:.1f}%" if mfu else "n/a",
        }
        if val is not None:
            shown["val_loss"] = f"{val:.3f}"
        self.bar.set_postfix(shown)
        if self.log_lines:
            print(f"step {done}/{self.run.cfg.steps} " + " ".join(f"{k} {v}" for k, v in shown.items()), flush=True)
        self.window_start, self.window_steps = time.perf_counter(), 0

    def close(self) -> None:
        self.bar.close()
        self.log.close()
