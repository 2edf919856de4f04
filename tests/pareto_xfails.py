"""The rows where tests/test_pareto_megatron.py's criteria do not hold today, with the numbers
(2-core CPU, 8 simulated devices, jax 0.10.2): "bytes" per device and modelled µs are both plans'
compiled HLO priced by sf.LinkModel() (benchmarks/hlo_pricing.py), "flops" XLA's cost analysis;
ours first, GSPMD's second. mlp_muon under tp may take GSPMD's strategy where that is cheaper
(an accepted exception); it does not today, so its rows are listed like the others."""

PARETO_XFAIL = {  # "program-strategy-planner": ours vs GSPMD
    "cnn-tp-greedy": "20.85 > 10.98 µs (4 vs 2 coll.)",
    "resnet-dp-greedy": "106.05 > 56.04 µs (31 vs 11 coll.)",
    "resnet-fsdp-greedy": "141.20 > 121.48 µs (67 vs 51 coll.)",
    "resnet-tp-greedy": "136.72 > 77.63 µs (38 vs 15 coll.)",
    "resnet-2d-greedy": "161.79 > 147.72 µs (60 vs 49 coll.)",
    "vit-tp-greedy": "30.94 > 26.23 µs (8 vs 5 coll.)",
    "lm-tp-greedy": "76.36 > 51.33 µs (23 vs 10 coll.)",
    "lstm-fsdp-greedy": "581.43 > 181.33 µs (304 vs 60 coll.)",
    "mlp_adamw-tp-greedy": "35.06 > 15.05 µs (8 vs 3 coll.)",
    "mlp_adamw-2d-greedy": "45.05 > 40.06 µs (13 vs 9 coll.)",
    "mlp_adafactor-tp-greedy": "70.06 > 50.06 µs (16 vs 11 coll.)",
    "mlp_lion-tp-greedy": "35.05 > 15.05 µs (8 vs 3 coll.)",
    "mlp_lion-2d-greedy": "45.05 > 40.06 µs (13 vs 9 coll.)",
    "mlp_lamb-tp-greedy": "70.07 > 50.06 µs (15 vs 10 coll.)",
    "mlp_muon-fsdp-greedy": "105.64 > 85.48 µs (36 vs 17 coll.)",
    "mlp_muon-tp-greedy": "190.67 > 70.48 µs (39 vs 14 coll.)",
    "ce_integer-tp-greedy": "bytes 2,310 > 2,304 and flops 21,237 > 20,865; 25.07 > 10.07 µs (6 vs 2 coll.)",
    "ce_integer-2d-greedy": "bytes 1,159 > 1,156 and flops 10,627 > 10,440; 25.03 > 15.03 µs (6 vs 3 coll.)",
    "ce_onehot-tp-greedy": "20.10 > 15.10 µs (6 vs 3 coll.)",
    "moe-dp-greedy": "59.02 > 39.43 µs (10 vs 4 coll.)",
    "moe-ep-greedy": "101.06 > 70.77 µs (19 vs 12 coll.)",
    "moe-2d-greedy": "90.82 > 75.96 µs (16 vs 13 coll.)",
    "reductions-dp-greedy": "35.04 > 25.04 µs (9 vs 7 coll.)",
    "reductions-2d-greedy": "bytes 1,389 > 1,124 and flops 3,626 > 2,404",
    "cnn-tp-solver": "20.85 > 10.98 µs (4 vs 2 coll.)",
    "cnn-2d-solver": "bytes 135,248 > 69,712 and flops 1,286,600 > 1,154,464",
    "resnet-dp-solver": "bytes 585,725 > 71,533 and flops 8,886,302 > 6,742,783; 61.33 > 56.04 µs (11 vs 11 coll.)",
    "resnet-tp-solver": "bytes 497,661 > 209,356 and flops 8,902,050 > 7,780,877",
    "vit-tp-solver": "41.38 > 26.23 µs (8 vs 5 coll.)",
    "vit-2d-solver": "bytes 172,640 > 105,648 and flops 1,966,711 > 1,906,363",
    "lm-2d-solver": "bytes 276,551 > 220,156 and flops 1,799,080 > 1,656,370",
    "mlp_adamw-tp-solver": "bytes 22,788 > 3,990 and flops 64,332 > 50,467; 15.22 > 15.05 µs (3 vs 3 coll.)",
    "mlp_adafactor-fsdp-solver": "bytes 14,469 > 5,551 and flops 77,130 > 43,394",
    "mlp_adafactor-tp-solver": "bytes 22,503 > 4,716 and flops 92,324 > 55,448",
    "mlp_adafactor-2d-solver": "bytes 25,171 > 6,420 and flops 89,927 > 45,238",
    "mlp_lion-tp-solver": "bytes 22,788 > 3,990 and flops 61,078 > 47,213; 15.22 > 15.05 µs (3 vs 3 coll.)",
    "mlp_lamb-tp-solver": "55.06 > 50.06 µs (11 vs 10 coll.)",
    "mlp_muon-fsdp-solver": "120.62 > 85.48 µs (25 vs 17 coll.)",
    "ce_integer-tp-solver": "bytes 49,152 > 2,304 and flops 56,201 > 20,865",
    "ce_integer-2d-solver": "bytes 24,583 > 1,156 and flops 28,288 > 10,440",
    "ce_onehot-tp-solver": "bytes 98,304 > 3,072 and flops 155,527 > 49,537",
    "moe-dp-solver": "40.37 > 39.43 µs (5 vs 4 coll.)",
    "moe-2d-solver": "bytes 508,672 > 403,482 and flops 96,440,104 > 95,935,720",
    "reductions-tp-solver": "bytes 3,072 > 876 and flops 17,887 > 4,545",
    "reductions-2d-solver": "bytes 3,584 > 1,124 and flops 17,887 > 2,404",
    "llama_train-dp-greedy": "546.05 > 470.90 µs (5 vs 5 coll.; the work: XLA's bytes accessed)",
}

# "strategy-planner-check": a layer's collectives over 'model' vs Megatron's (bytes per device,
# modelled µs), or the layer weights gathered whole
MEGATRON_XFAIL = {
    # greedy reduce-scatters each layer input's gradient in the backward (cheaper than the
    # all-reduce where it is made) and all-gathers it at the next trip's residual constraint: one
    # more collective's latency per layer on this tiny model, but the backward's elementwise work
    # then runs on a quarter of the tokens. Made to see the gather (the carry wanted as the body
    # pins it), greedy all-reduced as Megatron does, and its 1b / 7b plans were modelled 9-10 %
    # slower (88.4 -> 97.5 ms at 1b fsdp): greedy does not price local work
    "tp-greedy-bytes": "3,147,264 > 3,145,728 B: the norm-scale gradients also reduced over model (768 B each)",
    "tp-greedy-seconds": "50.98 > 40.97 µs: backward reduce-scatter + all-gather pairs, not all-reduces",
}
