"""The HetPipe paper's §8 numbers, in one place (Park et al., "HetPipe", USENIX ATC '20; the text in
``/work/shared/seeds/002_*``).

Transcribed by hand from the paper's text and tables, each with its section / table. Nothing here is computed:
the calibration (:mod:`experiments.paper.calibration`) and the experiments read these values, and every value an
experiment reports beside one of them is either named a calibration cell (``CALIBRATION_CELLS``) or a prediction.

Units: images/s at batch 32 per minibatch (per GPU for Horovod); "MB" in the paper is MiB (its VGG-19 "548MB" of
parameters is our profile's 574.7e6 bytes = 548.0 MiB; ResNet-152's "230MB" is 240.8e6 bytes = 229.6 MiB).

What is *not* here, because the paper gives it only in plots: Figure 3's per-Nm bars, its boxed Nm = 1 images/s,
and Figure 4's NP / ED / HD / ED (default placement) bars. Figure 4's ED-local and Horovod bars are Table 4's last
column (HetPipe 606 and 580 images/s; Horovod 339 on 16 GPUs for VGG-19 and 415 on 12 for ResNet-152), which the
§8.3 text confirms (ED-local "1.8 times higher than Horovod" for VGG-19: 606 / 339 = 1.79; "40% higher" for
ResNet-152: 580 / 415 = 1.40).
"""

from __future__ import annotations

MODELS = ("vgg19_imagenet", "resnet152_imagenet")
MODEL_NAMES = {"vgg19_imagenet": "VGG-19", "resnet152_imagenet": "ResNet-152"}
BATCH_SIZE = 32  # §8.1: "For each DNN model, batch size of 32 is used."

# §8.1 Table 1: node name -> GPU type (4 GPUs each; our cluster file experiments/clusters/hetpipe_paper.json).
NODE_TYPES = {"V": "TITAN V", "R": "TITAN RTX", "G": "GeForce RTX 2060", "Q": "Quadro P4000"}

# §8.1 Table 3: resource allocation of each virtual worker.
TABLE3_ALLOCATIONS = {
    "NP": ("VVVV", "RRRR", "GGGG", "QQQQ"),
    "ED": ("VRGQ", "VRGQ", "VRGQ", "VRGQ"),
    "HD": ("VVQQ", "VVQQ", "RRGG", "RRGG"),
}
# §8.2: "the 7 distinct virtual workers that are possible according to the allocation schemes in Table 3".
DISTINCT_VWS = ("VVVV", "RRRR", "GGGG", "QQQQ", "VRGQ", "VVQQ", "RRGG")

# §8.3 Table 4: nodes used per column ("4 TITAN V -> + TITAN RTX -> + Quadro P4000 -> + RTX 2060"; HetPipe one VW
# for the first column, four VWs (ED-local) after).
TABLE4_COLUMNS = ("V4", "V4R4", "V4R4Q4", "V4R4Q4G4")
TABLE4_NODES = {"V4": ("V",), "V4R4": ("V", "R"), "V4R4Q4": ("V", "R", "Q"), "V4R4Q4G4": ("V", "R", "Q", "G")}
TABLE4_NUM_VWS = {"V4": 1, "V4R4": 4, "V4R4Q4": 4, "V4R4Q4G4": 4}
# images/s; None = "X" in the paper (ResNet-152 does not fit an RTX 2060, so Horovod cannot use 16 GPUs).
TABLE4_HOROVOD = {
    "vgg19_imagenet": {"V4": 164, "V4R4": 205, "V4R4Q4": 265, "V4R4Q4G4": 339},
    "resnet152_imagenet": {"V4": 233, "V4R4": 353, "V4R4Q4": 415, "V4R4Q4G4": None},
}
TABLE4_HETPIPE = {
    "vgg19_imagenet": {"V4": 300, "V4R4": 530, "V4R4Q4": 572, "V4R4Q4G4": 606},
    "resnet152_imagenet": {"V4": 256, "V4R4": 516, "V4R4Q4": 538, "V4R4Q4G4": 580},
}
# Table 4's parenthesised numbers: total concurrent minibatches (Nm x number of VWs).
TABLE4_HETPIPE_CONCURRENT = {
    "vgg19_imagenet": {"V4": 5, "V4R4": 16, "V4R4Q4": 20, "V4R4Q4G4": 20},
    "resnet152_imagenet": {"V4": 5, "V4R4": 20, "V4R4Q4": 24, "V4R4Q4G4": 28},
}
TABLE4_MAX_SPEEDUP = 2.3  # §8.3: "having up to 2.3 times speedup" (HetPipe V4R4Q4G4 over V4: 580 / 256 = 2.27).

# §8.3, Figure 4 text.
PARAM_MIB = {"vgg19_imagenet": 548, "resnet152_imagenet": 230}
HOROVOD_GPUS_FIG4 = {"vgg19_imagenet": 16, "resnet152_imagenet": 12}  # "Horovod uses only 12 GPUs" (ResNet-152)
# "the amount of data transferred across the nodes": ED-local vs Horovod, MB (= MiB, see module docstring).
FIG4_CROSS_NODE_MIB = {
    "vgg19_imagenet": {"ED-local": 103, "Horovod": 515},
    "resnet152_imagenet": {"ED-local": 298, "Horovod": 211},
}
# "the performance of ED-local ... is 1.8 times higher than Horovod" (VGG-19); "still 40% higher" (ResNet-152).
FIG4_EDLOCAL_OVER_HOROVOD = {"vgg19_imagenet": 1.8, "resnet152_imagenet": 1.4}
FIG4_OBSERVATIONS = (
    "VGG-19: Horovod is faster than NP, ED and HD (default placement)",
    "ResNet-152: ED and HD are similar to Horovod (12 GPUs)",
    "NP is slow: its Nm is bounded by the VW with the smallest GPU memory",
)

# §8.4 (convergence; reproduced on branch paper-conv, listed so that REPRODUCTION.md has a row for each).
CONVERGENCE_CLAIMS = {
    "fig5_hetpipe12_vs_horovod12": "HetPipe (12 GPUs, D=0) converges 35% faster than Horovod (12 GPUs)",
    "fig5_hetpipe16_vs_horovod12": "HetPipe (16 GPUs, D=0) converges 39% faster than Horovod (12 GPUs)",
    "fig6_d0_vs_horovod": "VGG-19, 16 GPUs: HetPipe D=0 converges 29% faster than Horovod",
    "fig6_d4_vs_d0": "D=4 converges 28% faster than D=0",
    "fig6_d4_vs_horovod": "D=4 converges 49% faster than Horovod",
    "fig6_d32_vs_d4": "D=32 converges 4.7% slower than D=4",
    "waiting_d4_over_d0": "waiting time with D=4 is 62% of that with D=0",
    "idle_over_waiting": "idle time is 18% of the waiting time",
}


def table4_cells(which: str = "both"):
  """Yields ``(model, method, column, images_per_s)`` of every Table 4 cell with a number (``which``: "horovod",
  "hetpipe" or "both")."""
  tables = {"horovod": TABLE4_HOROVOD, "hetpipe": TABLE4_HETPIPE}
  for method in (("horovod", "hetpipe") if which == "both" else (which,)):
    for model in MODELS:
      for col in TABLE4_COLUMNS:
        v = tables[method][model][col]
        if v is not None:
          yield model, method, col, v
