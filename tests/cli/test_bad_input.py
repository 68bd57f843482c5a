"""Bad input through the real command-line tools, as a careless or hostile user gives it:
each case must end with exit status 2, exactly one line on stderr that names the problem,
no traceback, and no files left behind. The cases run as real processes, four at a time.
"""

from __future__ import annotations

import gzip
import os
import pickle
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import ROOT, stderr_lines

T = "{tmp}"  # replaced by the case's own folder

TRAIN = [
    ("strategy unknown", ["--strategy", "nope"], "unknown strategy 'nope'"),
    ("model unknown", ["--model", "vgg"], "unknown model 'vgg'"),
    ("dataset unknown", ["--dataset", "imagenet"], "unknown data set 'imagenet'"),
    ("optimizer unknown", ["--optimizer", "lbfgs"], "--optimizer must be one of"),
    ("loss unknown", ["--loss", "hinge"], "unknown loss 'hinge'"),
    ("steps zero", ["--steps", "0"], "--steps must be an integer in [1,"),
    ("steps negative", ["--steps", "-5"], "--steps must be an integer in [1,"),
    ("steps not a number", ["--steps", "ten"], "--steps: invalid int value"),
    ("batch larger than the data", ["--batch-size", "5000"], "is larger than the 1437"),
    ("batch zero", ["--batch-size", "0"], "--batch-size must be an integer in [1,"),
    ("lr negative", ["--lr", "-1"], "--lr must be a finite number > 0"),
    ("lr nan", ["--lr", "nan"], "--lr must be a finite number > 0"),
    ("lr inf", ["--lr", "inf"], "--lr must be a finite number > 0"),
    ("momentum 1.5", ["--momentum", "1.5"], "--momentum must be a finite number >= 0 and < 1"),
    ("weight decay negative", ["--weight-decay", "-1"], "--weight-decay must be a finite number >= 0"),
    ("decay factor negative", ["--lr-decay-factor", "-2"], "--lr-decay-factor must be a finite number > 0"),
    ("step schedule without period", ["--lr-schedule", "step"], "needs --lr-decay-every"),
    ("warm-up negative", ["--warmup-steps", "-1"], "--warmup-steps must be an integer in [0,"),
    ("seed negative", ["--seed", "-1"], "--seed must be an integer in [0, 4294967295]"),
    ("seed of 24 digits", ["--seed", "1" * 24], "--seed must be an integer in [0, 4294967295]"),
    ("devices zero", ["--devices", "0"], "--devices must be an integer in [1,"),
    ("reshard without resume", ["--reshard"], "--reshard continues a checkpoint on another"),
    ("devices for single", ["--devices", "2"], "--strategy single runs on one device, not 2"),
    ("mesh of the wrong size", ["--strategy", "hybrid", "--devices", "8", "--mesh", "data=3"],
     "multiplies to 3 devices but --devices is 8"),
    ("mesh axis unknown", ["--strategy", "hybrid", "--devices", "2", "--mesh", "tensor=2"],
     "AXIS one of data, fsdp, expert, context, model, pipe"),
    ("mlp hidden zero", ["--model", "mlp", "--model-opt", "hidden=0"],
     "--model-opt hidden='0': must be integers in [1,"),
    ("resnet width zero", ["--model", "resnet", "--model-opt", "width=0"],
     "--model-opt width='0': must be an integer in [1, 4096]"),
    ("lenet5 act swish", ["--model-opt", "act=swish"], "--model-opt act='swish': must be one of"),
    ("resnet depth not 6n+2", ["--model", "resnet", "--model-opt", "depth=21"], "6n+2"),
    ("model option unknown", ["--model-opt", "nope=1"], "model 'lenet5' has no option 'nope'"),
    ("model option without value", ["--model-opt", "hidden"], "--model-opt takes KEY=VALUE"),
    ("vocab size zero", ["--model", "transformer", "--data-opt", "vocab_size=0"],
     "--data-opt vocab_size='0': must be an integer in [2,"),
    ("seq_len not a number", ["--model", "lstm_lm", "--data-opt", "seq_len=abc"],
     "--data-opt seq_len='abc'"),
    ("timeout nan", ["--timeout", "nan"], "--timeout must be a finite number > 0"),
    ("timeout negative", ["--timeout", "-1"], "--timeout must be a finite number > 0"),
    ("cp without a context axis", ["--strategy", "hybrid", "--devices", "4", "--mesh",
                                   "data=2,model=2", "--cp", "all-to-all"],
     "--cp all-to-all sets how a context axis attends; the mesh has none"),
    ("owt preset without a model axis", ["--strategy", "hybrid", "--devices", "2", "--mesh",
                                         "data=2", "--preset", "owt"],
     "--preset owt splits layers over a model axis; the mesh has none"),
    ("owt preset with data", ["--strategy", "data", "--devices", "2", "--preset", "owt"],
     "--preset is an option of --strategy hybrid, not of --strategy data"),
    ("allreduce with single", ["--allreduce", "ring"], "--allreduce is an option of --strategy data"),
    ("compression ratio 2", ["--strategy", "data", "--devices", "2", "--compress", "topk:2"],
     "--compress 'topk:2'"),
    ("schedule unknown", ["--strategy", "pipeline", "--devices", "2", "--schedule", "zigzag"],
     "--schedule must be one of"),
    ("chunks zero", ["--strategy", "pipeline", "--devices", "2", "--chunks", "0"],
     "--chunks must be an integer in [1, 256]"),
    ("stage boundaries not numbers", ["--strategy", "pipeline", "--devices", "2",
                                      "--stage-boundaries", "a,b"], "like 2,5"),
    ("microbatches zero", ["--microbatches", "0"], "--microbatches must be an integer in [1,"),
    ("microbatches not dividing the batch", ["--microbatches", "3"], "use a multiple of 3"),
    ("stages not devices", ["--strategy", "pipeline", "--devices", "2", "--stages", "3"],
     "--stages 3 needs --devices 3"),
    ("plot with data", ["--strategy", "data", "--devices", "2", "--plot-schedule", "g.png"],
     "--plot-schedule is an option of --strategy hybrid, pipeline"),
    ("plot into /proc", ["--strategy", "pipeline", "--devices", "2", "--plot-schedule",
                         "/proc/refdl/g.png"], "--plot-schedule /proc/refdl/g.png: cannot write"),
    ("plot not an image", ["--strategy", "pipeline", "--devices", "2", "--plot-schedule",
                           f"{T}/g.txt"], "give a .png, .pdf or .svg file"),
    ("out under /proc", ["--out", "/proc/refdl-run"], "--out /proc/refdl-run: cannot write there"),
    ("out is a file", ["--out", f"{T}/afile"], "is a file; give a folder"),
    ("resume of nothing", ["--resume", "/nonexistent/run"], "no checkpoint there"),
    ("resume of a damaged run", ["--resume", f"{T}/damaged"], "no intact checkpoint"),
    ("mnist without a folder", ["--dataset", "mnist"], "pass --data-dir DIR"),
    ("mnist folder missing", ["--dataset", "mnist", "--data-dir", "/nonexistent"],
     "/nonexistent: not a readable directory"),
    ("truncated gzip IDX", ["--dataset", "mnist", "--data-dir", f"{T}/gz"],
     "damaged or truncated gzip file"),
    ("IDX with no examples", ["--dataset", "mnist", "--data-dir", f"{T}/empty"],
     "holds no examples"),
    ("negative labels", ["--dataset", "mnist", "--data-dir", f"{T}/neglabels"],
     "label -3 is negative"),
    ("crafted CIFAR pickle", ["--dataset", "cifar10", "--data-dir", f"{T}/evil"],
     "refused to load posix.system: data files are data"),
    ("LSTM on images", ["--model", "lstm_lm", "--dataset", "digits"],
     "model 'lstm_lm' needs a tokens data set"),
    ("ps without ranks", ["--strategy", "ps"], "--strategy ps needs server and worker ranks"),
    ("ps servers zero", ["--strategy", "ps", "--simulate", "--servers", "0"],
     "--servers must be an integer in [1,"),
    ("ps mode unknown", ["--strategy", "ps", "--simulate", "--ps-mode", "lazy"],
     "--ps-mode must be one of sync, async, ssp"),
    ("ssp without a bound", ["--strategy", "ps", "--simulate", "--ps-mode", "ssp"],
     "--ps-mode ssp needs --staleness"),
    ("bound without ssp", ["--strategy", "ps", "--simulate", "--staleness", "2"],
     "--staleness is the bound of --ps-mode ssp"),
    ("workers without simulate", ["--strategy", "ps", "--workers", "2"], "add --simulate"),
    ("straggler malformed", ["--strategy", "ps", "--simulate", "--straggler", "x"],
     "--straggler takes RANK:SECONDS"),
    ("topology unknown", ["--strategy", "decentralized", "--devices", "4", "--topology", "star"],
     "unknown --topology 'star'"),
    ("torus of 3", ["--strategy", "decentralized", "--devices", "3", "--batch-size", "60",
                    "--topology", "torus"], "torus needs a worker count"),
    ("gossip with data", ["--strategy", "data", "--devices", "2", "--gossip"],
     "--gossip is an option of --strategy decentralized"),
    ("keep no checkpoints", ["--keep-checkpoints", "0"], "--keep-checkpoints must be an integer"),
    ("eval every -1", ["--eval-every", "-1"], "--eval-every must be an integer in [0,"),
    ("flag unknown", ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
]  # fmt: skip

OTHERS = [
    ("predict: microbatches zero", "refdl.predict",
     ["--hw", "p100-nvlink", "--strategy", "pipeline", "--model", "mlp", "--microbatches", "0"],
     "--microbatches must be an integer in [1,"),
    ("predict: chunks zero", "refdl.predict",
     ["--hw", "p100-nvlink", "--strategy", "pipeline", "--model", "mlp", "--schedule",
      "interleaved", "--chunks", "0"], "--chunks must be an integer in [1, 256]"),
    ("predict: schedule unknown", "refdl.predict",
     ["--hw", "p100-nvlink", "--strategy", "pipeline", "--model", "mlp", "--schedule", "zigzag"],
     "--schedule must be one of"),
    ("predict: servers zero", "refdl.predict",
     ["--hw", "p100-nvlink", "--strategy", "ps", "--model", "mlp", "--servers", "0"],
     "--servers must be an integer in [1,"),
    ("predict: more servers than workers", "refdl.predict",
     ["--hw", "p100-nvlink", "--strategy", "ps", "--model", "mlp", "--servers", "8",
      "--workers", "4"], "--servers 8 exceeds --workers 4"),
    ("predict: ps mode unknown", "refdl.predict",
     ["--hw", "p100-nvlink", "--strategy", "ps", "--model", "mlp", "--ps-mode", "lazy"],
     "--ps-mode must be one of sync, async, ssp"),
    ("predict: strategy unknown", "refdl.predict",
     ["--hw", "p100-nvlink", "--strategy", "zero", "--model", "mlp"],
     "unknown --strategy 'zero'; choose one of context, data, decentralized, fsdp, hybrid,"),
    ("predict: bytes nan", "refdl.predict",
     ["collective", "--hw", "p100-nvlink", "--workers", "4", "--bytes", "nan"],
     "--bytes must be a finite number >= 0"),
    ("predict: bytes negative", "refdl.predict",
     ["collective", "--hw", "p100-nvlink", "--workers", "4", "--bytes", "-1"],
     "--bytes must be a finite number >= 0"),
    ("predict: devices_per_node true", "refdl.predict",
     ["--hw", f"{T}/bool.toml", "--model", "mlp"], "devices_per_node must be an integer >= 1"),
    ("predict: profile not UTF-8", "refdl.predict",
     ["--hw", f"{T}/latin1.toml", "--model", "mlp"], "not UTF-8 text"),
    ("predict: profile missing", "refdl.predict",
     ["--hw", f"{T}/none.toml", "--model", "mlp"], "no such file"),
    ("predict: plot into /proc", "refdl.predict",
     ["--hw", "p100-nvlink", "--model", "mlp", "--plot", "/proc/refdl/s.png"],
     "--plot /proc/refdl/s.png: cannot write"),
    ("predict: model unknown", "refdl.predict", ["--hw", "p100-nvlink", "--model", "nope"],
     "unknown --model 'nope'"),
    ("predict: workers not numbers", "refdl.predict",
     ["--hw", "p100-nvlink", "--model", "mlp", "--workers", "x"], "--workers 'x'"),
    ("predict: overlap 2", "refdl.predict",
     ["--hw", "p100-nvlink", "--model", "mlp", "--overlap", "2"], "--overlap must be"),
    ("predict: batch zero", "refdl.predict",
     ["--hw", "p100-nvlink", "--model", "mlp", "--batch-size", "0"], "--batch-size must be"),
    ("validate: devices zero", "refdl.validate",
     ["--strategy", "data", "--devices", "0", "--model", "mlp"], "--devices must be an integer in [1, 8]"),
    ("validate: devices 100000", "refdl.validate",
     ["--strategy", "data", "--devices", "100000", "--model", "mlp"], "--devices must be an integer in [1, 8]"),
    ("validate: steps zero", "refdl.validate", ["--steps", "0"], "--steps must be an integer"),
    ("validate: model without twin", "refdl.validate",
     ["--framework", "tensorflow", "--model", "transformer"], "the tensorflow adapter covers"),
    ("validate: log with steps abc", "refdl.validate", ["--results", f"{T}/log.jsonl"],
     "row 1: step must be an integer in [0,"),
    ("validate: log missing", "refdl.validate", ["--results", f"{T}/nolog.jsonl"], "no such file"),
    ("validate: report into /proc", "refdl.validate",
     ["--results", f"{T}/good.jsonl", "--report", "/proc/refdl/report"],
     "--report /proc/refdl/report: cannot write"),
    ("recipe: min high", "refdl.bench", ["run", f"{T}/min.toml"],
     "[acceptable] TestAccuracy min must be a finite number"),
    ("recipe: timeout long", "refdl.bench", ["run", f"{T}/timeout.toml"],
     "[options] timeout must be a finite number > 0"),
    ("recipe: fixed not a table", "refdl.bench", ["run", f"{T}/fixed.toml"],
     "[fixed] must be a table"),
    ("recipe: unknown section", "refdl.bench", ["run", f"{T}/section.toml"],
     "unknown section(s)"),
    ("bench: command unknown", "refdl.bench", ["nope"], "unknown command 'nope'; choose one of: predict-vs-measure"),
    ("data: out into /proc", "refdl.data",
     ["convert", "--dataset", "digits", "--out", "/proc/refdl/d.zarr"],
     "--out /proc/refdl/d.zarr: cannot write"),
    ("data: dataset unknown", "refdl.data", ["convert", "--dataset", "nope", "--out", f"{T}/z"],
     "unknown data set 'nope'"),
    ("data: crafted CIFAR pickle", "refdl.data",
     ["convert", "--dataset", "cifar10", "--data-dir", f"{T}/evil", "--out", f"{T}/z"],
     "refused to load posix.system"),
    ("hw: profile unknown", "refdl.hw", ["show", "nope"], "unknown hardware profile 'nope'"),
    # 2026-11-27, a fuzzing pass: a traceback, or a value accepted that meant nothing
    ("hw: calibrate a name with a path", "refdl.hw", ["calibrate", "--name", "../../x"],
     "a profile's name is letters"),
    ("predict: a shape of 1e11 layers", "refdl.predict",
     ["--hw", "a100-nvlink", "--model-shape", "layers=99999999999,d_model=64,heads=1"],
     "layers must be an integer in [1, 10000] (got 99999999999)"),
    ("predict: a config's layers true", "refdl.predict",
     ["--hw", "a100-nvlink", "--model-shape-file", f"{T}/hf_true.json"],
     "num_hidden_layers must be an integer (got True)"),
    ("predict: a config's tie 'false'", "refdl.predict",
     ["--hw", "a100-nvlink", "--model-shape-file", f"{T}/hf_tie.json"],
     "tie_word_embeddings must be true or false"),
    ("predict: servers with data", "refdl.predict",
     ["--hw", "p100-nvlink", "--model", "mlp", "--strategy", "data", "--servers", "2"],
     "--servers is an option of --strategy ps, not of --strategy data"),
    ("predict: a straggler with data", "refdl.predict",
     ["--hw", "p100-nvlink", "--model", "mlp", "--strategy", "data", "--straggler", "1:0.1"],
     "--straggler is an option of --strategy decentralized, ps"),
    ("predict: chunks under 1f1b", "refdl.predict",
     ["--hw", "p100-nvlink", "--model", "gpt2", "--strategy", "pipeline", "--workers", "4",
      "--chunks", "4"], "--chunks 4 needs --schedule interleaved or looped-bfs"),
    ("predict: more stages than layers", "refdl.predict",
     ["--hw", "p100-nvlink", "--model", "mlp", "--strategy", "pipeline", "--workers", "64"],
     "64 stages x 1 chunks = 64 need at least as many layers; mlp has 4"),
    ("bench compare: rounds zero", "refdl.bench",
     ["compare", "--frameworks", "refdl", "--rounds", "0"], "--rounds must be at least 1"),
    ("bench compare: model unknown", "refdl.bench",
     ["compare", "--frameworks", "refdl", "--model", "nosuch"], "unknown --model 'nosuch'"),
]  # fmt: skip

# Issue 32: files from elsewhere (special files, bombs, deep nesting, paths in files) and
# values that were accepted but meant nothing.
FOREIGN = [
    ("zero with single", "refdl.train", ["--zero", "3"],
     "--zero is an option of --strategy fsdp, not of --strategy single"),
    ("warm-up beyond steps", "refdl.train", ["--warmup-steps", "500", "--steps", "10"],
     "--warmup-steps 500 is beyond --steps 10"),
    ("servers beyond simulated workers", "refdl.train",
     ["--strategy", "ps", "--simulate", "--workers", "2", "--servers", "4", "--batch-size", "64"],
     "--servers 4 is more than the 2 simulated workers"),
    ("mnist label 255", "refdl.train", ["--dataset", "mnist", "--data-dir", f"{T}/biglabels"],
     "label 255 is not below 10 classes"),
    ("IDX of huge dimensions", "refdl.train", ["--dataset", "mnist", "--data-dir", f"{T}/huge"],
     "asks for 17179869184 bytes"),
    ("CIFAR nested-list bomb", "refdl.train", ["--dataset", "cifar10", "--data-dir", f"{T}/bomb"],
     "nested containers"),
    ("FIFO as a data file", "refdl.train", ["--dataset", "ptb", "--model", "lstm_lm",
                                            "--data-dir", f"{T}/fifodata"], "is a FIFO"),
    ("FIFO as a topology file", "refdl.train",
     ["--strategy", "decentralized", "--devices", "2", "--topology", f"{T}/fifo"], "is a FIFO"),
    ("deep JSON as a ps trace", "refdl.train",
     ["--strategy", "ps", "--simulate", "--ps-mode", "async", "--ps-trace", f"{T}/deep.json"],
     "nested deeper than 64 levels"),
    ("checkpoint manifest step true", "refdl.train", ["--resume", f"{T}/steptrue"],
     "lacks the format, step, settings or leaves"),
    ("checkpoints folder a link", "refdl.train", ["--out", f"{T}/linked"],
     "checkpoints is a link to"),
    ("predict: profile key unknown", "refdl.predict",
     ["--hw", f"{T}/unknownkey.toml", "--model", "mlp"], "key links.intra.bandwith is not one of"),
    ("predict: profile name with escapes", "refdl.predict",
     ["--hw", f"{T}/escape.toml", "--model", "mlp"], "without control characters"),
    ("predict: profile nested deep", "refdl.predict",
     ["--hw", f"{T}/deep.toml", "--model", "mlp"], "nested deeper than 64 levels"),
    ("predict: profile a FIFO", "refdl.predict", ["--hw", f"{T}/fifo.toml", "--model", "mlp"],
     "is a FIFO"),
    ("recipe: list for a number", "refdl.bench", ["run", f"{T}/steplist.toml"],
     "[fixed] steps must be an integer"),
    ("recipe: names out", "refdl.bench", ["run", f"{T}/recipeout.toml"], "never by a recipe"),
    ("recipe: a FIFO", "refdl.bench", ["run", f"{T}/fifo.toml"], "is a FIFO"),
    ("validate: log a FIFO", "refdl.validate", ["--results", f"{T}/fifo.jsonl"], "is a FIFO"),
]  # fmt: skip

# Issue 54's reliability harness: what hung, ended in a traceback or was accepted silently.
# fmt: off
THIRD_LOOK = [
    ("validate: final_params a FIFO", "refdl.validate", ["--results", f"{T}/fifoparams.jsonl"],
     "is a FIFO, not a regular file"),
    ("validate: step 999,999,999 undeclared", "refdl.validate",
     ["--results", f"{T}/farstep.jsonl"], "more than the 100,000 refdl reruns"),
    ("validate: a million steps declared", "refdl.validate",
     ["--results", f"{T}/million.jsonl"], "rerun of 1,000,000 steps"),
    ("validate: a CSV field of 1 MB", "refdl.validate", ["--results", f"{T}/wide.csv"],
     "field larger than field limit"),
    ("validate: CSV config a list", "refdl.validate", ["--results", f"{T}/configlist.csv"],
     "must hold a JSON object"),
    ("validate: export-start empty", "refdl.validate", ["--model", "mlp", "--export-start", ""],
     "--export-start is empty"),
    ("validate: optimizer lion, no phase line", "refdl.validate",
     ["--framework", "tensorflow", "--optimizer", "lion"], "--optimizer must be one of"),
    ("published: TOML nested 5000 deep", "refdl.bench", ["published", "--data", f"{T}/deep5000.toml"],
     "nested deeper than 64 levels"),
    ("published: empty data", "refdl.bench", ["published", "--data", f"{T}/emptydata.toml"],
     "no [[point]] tables"),
    ("predict-vs-measure: rounds 0", "refdl.bench", ["predict-vs-measure", "--rounds", "0"],
     "--rounds must be an integer in [1,"),
    ("zbv on 1 device", "refdl.train", ["--strategy", "pipeline", "--devices", "1", "--schedule",
                                        "zbv"], "orders the work of 2 or more pipeline stages"),
    ("schedule without stages", "refdl.train", ["--strategy", "hybrid", "--devices", "2",
                                                "--mesh", "data=2", "--schedule", "gpipe"],
     "--schedule gpipe needs pipeline stages"),
    ("three mistakes at once", "refdl.train", ["--steps", "0", "--lr", "-1", "--seed", "-2"],
     "3 problems: --steps must be"),
    ("layout mistakes at once", "refdl.train", ["--strategy", "hybrid", "--model", "moe",
                                                "--devices", "6", "--mesh", "expert=3,context=2",
                                                "--data-opt", "seq_len=21"],
     "3 problems: --batch-size 64 does not split into 3 shards"),
    ("hw: no command", "refdl.hw", [], "refdl hw: error: the following arguments are required"),
    ("data: no command", "refdl.data", [], "refdl data: error: the following arguments are"),
    ("launch: no command", "refdl.launch", [], "the following arguments are required: command"),
]

# Settings that would change nothing where they were given (a fuzzing pass, 2026-11-27):
# refused, as a strategy's option given to another strategy is.
UNUSED = [
    ("refdl: no command", "refdl", [], "refdl: error: no command given; choose one of: train"),
    ("data-dir for a built-in data set", "refdl.train", ["--data-dir", T],
     "data set 'digits' (8x8 handwritten digits) reads no folder; drop --data-dir"),
    ("decay period without the step schedule", "refdl.train", ["--lr-decay-every", "5"],
     "--lr-decay-every sets the step schedule's decay; add --lr-schedule step"),
    ("a shrinking batch schedule", "refdl.train", ["--batch-schedule", "0:64,10:32"],
     "each batch must be larger than the one before"),
    ("a model option twice", "refdl.train", ["--model", "mlp", "--model-opt", "hidden=32",
                                             "--model-opt", "hidden=64"],
     "--model-opt gives hidden twice (32, 64); give it once"),
    ("a config's model options as a string", "refdl.train", ["--config", f"{T}/optstr.toml"],
     'optstr.toml: model_opts must be a table ([model_opts] then KEY = VALUE lines) '
     'or a list of "KEY=VALUE" strings'),
    ("stage boundaries and a plot without stages", "refdl.train",
     ["--strategy", "hybrid", "--devices", "2", "--mesh", "data=2", "--stage-boundaries", "2",
      "--plot-schedule", f"{T}/s.png"],
     "2 problems: --stage-boundaries 2 needs pipeline stages (pipe > 1); --plot-schedule"),
    ("timeout in one process", "refdl.train", ["--timeout", "60"],
     "--timeout 60 bounds how long a rank waits for the others under mpirun"),
    ("plan: steps without run", "refdl.plan", ["--hw", "local", "--model", "mlp", "--devices",
                                               "2", "--batch-size", "64", "--steps", "5"],
     "--steps is an option of --run"),
    ("validate: set without results", "refdl.validate", ["--set", "bogus=1"],
     "--set is an option of --results LOG"),
    ("predict: an empty worker count", "refdl.predict",
     ["--hw", "p100-nvlink", "--model", "resnet50", "--workers", "1,,2"],
     "--workers '1,,2': give integers like 4 or 1,2,4"),
    ("plan: an empty --out", "refdl.plan", ["--hw", "local", "--model", "mlp", "--devices", "2",
                                            "--batch-size", "64", "--run", "--out", ""],
     "--out is empty"),
    ("data: an empty --out", "refdl.data", ["convert", "--dataset", "digits", "--out", ""],
     "--out is empty"),
    ("validate: export-start beside a check", "refdl.validate",
     ["--results", f"{T}/good.jsonl", "--export-start", f"{T}/es"], "--export-start writes"),
    ("validate: seeds with a control", "refdl.validate",
     ["--results", f"{T}/good.jsonl", "--control", f"{T}/good.jsonl", "--seeds", "5"],
     "--seeds does nothing with --control: the two logs are judged alone"),
    ("validate: a model beside a log", "refdl.validate",
     ["--results", f"{T}/good.jsonl", "--model", "resnet"],
     "--model does nothing with --results: the log's settings"),
    ("compare: strict without a ratio", "refdl.bench", ["compare", "--frameworks", "refdl",
                                                        "--strict"], "--strict judges"),
    ("recipe: min above max", "refdl.bench", ["run", f"{T}/minmax.toml"],
     "TestAccuracy min 0.5 is above its max 0.1: no run could pass"),
    ("momentum with adam", "refdl.train", ["--model", "lstm_lm", "--momentum", "0.5"],
     "--momentum sets the heavy ball of --optimizer momentum and --optimizer nesterov; "
     "--optimizer adam has none"),
    ("predict: recomputation of a CNN", "refdl.predict",
     ["--hw", "p100-nvlink", "--model", "resnet50", "--remat", "full"],
     "--remat prices a transformer's layers, and resnet50 is priced by its compiled step"),
    ("plan: shapes' compute for an MLP", "refdl.plan", ["--hw", "local", "--model", "mlp",
                                                         "--devices", "2", "--batch-size", "64",
                                                         "--compute", "flops"],
     "--compute prices a transformer's layers, and mlp is priced by its compiled step"),
    ("published: a negative figure", "refdl.bench", ["published", "--data", f"{T}/negpoint.toml"],
     "point 0: value must be a finite number > 0"),
    ("collective: value bits of a dense ring", "refdl.predict",
     ["collective", "--hw", "p100-nvlink", "--workers", "4", "--bytes", "1e6", "--value-bits", "8"],
     "--value-bits goes with --op allreduce --algo sparse"),
    ("predict: an empty --hw", "refdl.predict", ["--hw", "", "--model", "resnet50"],
     "--hw is empty; give a profile"),
    ("validate: a gossip option for data", "refdl.validate",
     ["--strategy", "data", "--topology", "torus", "--steps", "1"],
     "--topology is an option of --strategy decentralized, not of --strategy data"),
    ("compare: a batch larger than the data", "refdl.bench",
     ["compare", "--frameworks", "refdl", "--rounds", "1", "--batch-size", "100000"],
     "--batch-size 100000 is larger than the 1437 training examples"),
    ("validate: Muon's iteration without Muon", "refdl.validate", ["--torch-muon-ns", "native"],
     "--torch-muon-ns sets torch.optim.Muon's Newton-Schulz; add --optimizer muon"),
    ("validate: PyTorch's perturbation for MXNet", "refdl.validate",
     ["--framework", "mxnet", "--perturb", "0.1"], "--perturb changes PyTorch's side"),
    ("validate: a schedule without stages", "refdl.validate", ["--schedule", "gpipe"],
     "--schedule orders pipeline stages; --strategy single has none"),
    ("launch: a one-process command on 2 ranks", "refdl.launch",
     ["-n", "2", "bench", "op-profile", "--model", "mlp"],
     "bench runs in one process (it starts any others it needs)"),
    ("op-profile: two billion steps", "refdl.bench", ["op-profile", "--model", "mlp", "--steps",
                                                      "2000000000"], "give 1 to 10000 steps"),
    ("collective: 1e30 bytes", "refdl.predict", ["collective", "--hw", "p100-nvlink", "--workers",
                                                 "4", "--bytes", "1e30"],
     "--bytes must be a finite number >= 0 and <= 1e+18"),
    ("predict: unfused attention under data", "refdl.predict",
     ["--hw", "h100-nvlink", "--model", "gpt2", "--strategy", "data", "--workers", "8",
      "--attention", "unfused"],
     "--attention changes nothing for --strategy data, which takes a transformer's activations "
     "whole, scores or not; drop it, or price a comparable layout as a mesh (--strategy hybrid "
     "--mesh data=N --microbatches 1), whose formula takes it"),
    ("predict: a gradient precision on one device", "refdl.predict",
     ["--hw", "h100-nvlink", "--model", "gpt2", "--strategy", "single", "--workers", "1",
      "--grad-reduce", "compute"],
     "--grad-reduce changes nothing for --strategy single, which reduces no gradients"),
    ("op-profile: a GPU's profile", "refdl.bench", ["op-profile", "--model", "mlp", "--hw",
                                                    "h100-nvlink"],
     "--hw h100-nvlink has no per-operation rates ([device.ops]"),
    ("validate: PyTorch's BatchNorm for a model without one", "refdl.validate",
     ["--model", "lenet5", "--torch-batchnorm", "native", "--steps", "1"],
     "--torch-batchnorm chooses PyTorch's BatchNorm, and --model lenet5 has none; drop it"),
    ("data: convert into a run folder", "refdl.data",
     ["convert", "--dataset", "digits", "--out", f"{T}/damaged"],
     "holds other files (checkpoints); give a new or empty folder"),
    ("predict: a model split train refuses", "refdl.predict",
     ["--hw", "p100-nvlink", "--model", "lenet5", "--strategy", "model", "--workers", "1,2,3"],
     "a 3-way model split of lenet5's width 8 is not even (train refuses it); use a model "
     "degree dividing 8"),
    ("predict: stage cuts for the even pipeline", "refdl.predict",
     ["--hw", "h100-nvlink", "--model", "gpt2", "--batch-size", "16", "--strategy", "pipeline",
      "--workers", "4", "--stage-boundaries", "3,6,9"],
     "--stage-boundaries changes nothing for --strategy pipeline, which prices P equal stages "
     "of a transformer's totals; drop it, or price a comparable layout as a mesh (--strategy "
     "hybrid --mesh pipe=N), whose formula takes it"),
    ("predict: stage cuts on a mesh without stages", "refdl.predict",
     ["--hw", "h100-nvlink", "--model", "gpt2", "--batch-size", "16", "--mesh", "data=4",
      "--stage-boundaries", "3,6,9"],
     "--stage-boundaries cuts pipeline stages, and --mesh data=4 has none; add pipe=N or drop it"),
    ("plan: no layout splits the batch", "refdl.plan",
     ["--hw", "h100-nvlink", "--model", "transformer", "--devices", "3", "--batch-size", "16"],
     "no layout of transformer on 3 devices splits it: the batch 16 must split"),
    ("predict: fewer samples than replicas", "refdl.predict",
     ["--hw", "h100-nvlink", "--model", "resnet50", "--batch-size", "1", "--workers", "1,2,4,8"],
     "--batch-size 1 is smaller than the 2 replicas it splits over at 2 workers; give at least 2"),
    ("predict: another strategy's option at its default", "refdl.predict",
     ["--hw", "a100-nvlink", "--model", "resnet50", "--strategy", "data", "--cp", "ring"],
     "--cp is an option of --strategy context, hybrid, not of --strategy data"),
    ("predict: fewer samples than microbatches", "refdl.predict",
     ["--hw", "a100-nvlink", "--model", "gpt2", "--strategy", "data", "--workers", "8",
      "--batch-size", "16", "--microbatches", "4"],
     "--batch-size 16 on 8 workers leaves 2 samples each, fewer than --microbatches 4; give at "
     "least 32"),
    ("predict: a shape's zero width", "refdl.predict",
     ["--hw", "h100-nvlink", "--model-shape", "layers=4,d_model=256,heads=4,ffn=0"],
     "--model-shape: ffn=0 would be read as its default (4 x d_model); leave ffn out"),
    ("predict: two sequence lengths", "refdl.predict",
     ["--hw", "h100-nvlink", "--model-shape", "layers=4,d_model=256,heads=4,seq=4096",
      "--seq-len", "2048"],
     "--model-shape seq=4096 and --seq-len 2048 disagree; give the sequence once"),
    ("predict: a shape, then a bad option", "refdl.predict",  # no shape line before it
     ["--hw", "h100-nvlink", "--model-shape", "layers=4,d_model=256,heads=4", "--strategy",
      "data", "--topology", "ring"],
     "--topology is an option of --strategy decentralized, not of --strategy data"),
    ("predict: products by shape for a compiled step", "refdl.predict",
     ["--hw", "a100-nvlink", "--model", "gpt2", "--workers", "8", "--compute", "flops"],
     "--compute flops changes nothing: gpt2 is priced by its compiled step"),
    ("predict: a Muon scheme without Muon", "refdl.predict",
     ["--hw", "a100-nvlink", "--model", "resnet50", "--strategy", "fsdp", "--muon", "owner"],
     "--muon owner is a scheme of --optimizer muon; add it"),
    ("predict: learner groups without the hierarchy", "refdl.predict",
     ["--hw", "a100-nvlink", "--model", "resnet50", "--strategy", "ps", "--ps-groups", "2"],
     "--ps-mode hierarchical and --ps-groups G go together"),
    ("predict: an allreduce for gossip", "refdl.predict",
     ["--hw", "a100-nvlink", "--model", "resnet50", "--strategy", "decentralized",
      "--allreduce", "sparse"],
     "--allreduce sparse sends the top-k of each replica's change; add --compress"),
    ("predict: compressed gossip without its allreduce", "refdl.predict",
     ["--hw", "a100-nvlink", "--model", "resnet50", "--strategy", "decentralized",
      "--compress", "topk:0.01"],
     "decentralized sends compressed replicas as top-k pairs; add --allreduce sparse"),
    ("predict: compressed gossip on a changing graph", "refdl.predict",
     ["--hw", "a100-nvlink", "--model", "resnet50", "--strategy", "decentralized",
      "--allreduce", "sparse", "--compress", "topk:0.01", "--gossip"],
     "--gossip changes the graph every step: drop one"),
    # 2026-11-28, a review's bad input that was priced as if valid
    ("predict: a near strategy", "refdl.predict",
     ["--hw", "a100-nvlink", "--model", "gpt2", "--strategy", "hybridd"],
     "unknown --strategy 'hybridd'; did you mean hybrid?"),
    ("predict: chunks of a plain schedule", "refdl.predict",
     ["--hw", "h100-nvlink", "--model", "gpt3-1.3b", "--batch-size", "64", "--mesh",
      "data=2,pipe=4", "--chunks", "2"],
     "--chunks 2 needs --schedule interleaved or looped-bfs"),
    ("predict: a schedule without stages", "refdl.predict",
     ["--hw", "h100-nvlink", "--model", "gpt3-1.3b", "--batch-size", "64", "--mesh",
      "data=4,model=2", "--schedule", "interleaved"],
     "--schedule interleaved orders the work of 2 or more pipeline stages, and the mesh"),
    ("predict: more chunks than layers", "refdl.predict",
     ["--hw", "h100-nvlink", "--model", "gpt3-1.3b", "--batch-size", "64", "--mesh",
      "data=2,pipe=4", "--schedule", "interleaved", "--chunks", "8", "--microbatches", "8"],
     "4 stages x 8 chunks = 32 need at least as many layers; gpt3-1.3b has 24 (and its"),
    ("predict: a mesh axis data does not split", "refdl.predict",
     ["--hw", "h100-nvlink", "--model", "gpt2", "--strategy", "data", "--batch-size", "64",
      "--mesh", "data=4,model=2"],
     "--strategy data splits over data, not model; use --strategy hybrid or model"),
    ("predict: a batch the workers do not divide", "refdl.predict",
     ["--hw", "h100-nvlink", "--model", "resnet50", "--strategy", "data", "--batch-size",
      "100", "--workers", "1,8"],
     "--batch-size 100 does not split over the 8 replicas of 8 workers"),
    ("predict: a config's zero width", "refdl.predict",
     ["--hw", "h100-nvlink", "--model-shape-file", f"{T}/kv0.json"],
     "num_key_value_heads is 0, which would be read as its default (heads)"),
    ("predict: a compressed value width twice", "refdl.predict",
     ["--hw", "p100-nvlink", "--strategy", "data", "--model", "resnet50", "--batch-size", "64",
      "--workers", "8", "--compress", "topk:0.01,q8,q4", "--allreduce", "sparse"],
     "--compress 'topk:0.01,q8,q4': a value width (q8, q4) given twice; give it once"),
    ("predict: a folder as a config", "refdl.predict",
     ["--hw", "h100-nvlink", "--model-shape-file", T],
     "a folder, not a config.json"),
    ("predict: the rest of no device count", "refdl.predict",
     ["--hw", "h100-nvlink", "--model", "gpt2", "--batch-size", "64", "--mesh",
      "model=2,data=-1"],
     "--mesh model=2,data=-1 gives an axis -1, the rest of the devices; say how many with"),
    ("validate: a set key that is no key", "refdl.validate",
     ["--results", f"{T}/good.jsonl", "--set", "model=mlp", "--set", "bogus=1"],
     "--set bogus: not a configuration key; known: model, strategy,"),
    ("validate: a set key twice", "refdl.validate",
     ["--results", f"{T}/good.jsonl", "--set", "model=mlp", "--set", "model=lenet5"],
     "--set gives model twice; give it once"),
    ("bench: a set key twice", "refdl.bench",
     ["run", str(ROOT / "recipes" / "digits-data.toml"), "--set", "devices=2", "--set",
      "devices=4"],
     "--set gives devices twice; give it once"),
    ("validate: a start over another", "refdl.validate",
     ["--export-start", f"{T}/oldstart", "--model", "mlp", "--steps", "2"],
     "holds another start (fingerprint 0123456789abcdef; this one's"),
    ("validate: a start into a run", "refdl.validate",
     ["--export-start", f"{T}/arun", "--model", "mlp", "--steps", "2"],
     "/arun holds a training run (config.json); give a new folder"),
    ("plan: a precision twice", "refdl.plan",
     ["--hw", "a100-nvlink", "--model", "gpt3-1.3b", "--devices", "8", "--batch-size", "64",
      "--precision", "bf16,bf16"],
     "--precision 'bf16,bf16': give fp32, bf16 or fp32,bf16 (each once)"),
    ("plan: a precision the card lacks", "refdl.plan",
     ["--hw", "p100-nvlink", "--model", "gpt3-1.3b", "--devices", "8", "--batch-size", "64",
      "--precision", "bf16"],
     "--precision bf16: p100-nvlink's Tesla P100 SXM2 lists no bf16 peak"),
    ("plan: a shape's negative sequence", "refdl.plan",
     ["--hw", "a100-nvlink", "--model-shape", "layers=4,d_model=256,heads=4", "--devices",
      "8", "--batch-size", "64", "--seq-len=-1"],
     "--seq-len must be an integer in [1, 16777216] (got -1)"),
]

CASES = [(name, "refdl.train", args, msg) for name, args, msg in TRAIN] + OTHERS + FOREIGN
CASES += THIRD_LOOK + UNUSED


class Evil:
    """A pickle that would run ``os.system`` when loaded: it must never be."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def idx(path: Path, array, gz: bool = False) -> None:
    import numpy as np

    a = np.asarray(array, np.uint8)
    data = bytes([0, 0, 0x08, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape) + a.tobytes()
    if gz:
        data = gzip.compress(data)[:-12]  # truncated
    path.write_bytes(data)


def make_inputs(tmp: Path) -> None:
    """The files the cases read: damaged data sets, profiles, logs, recipes, a run."""
    import numpy as np

    (tmp / "afile").write_text("not a folder\n")
    shape = '"hidden_size": 64, "num_attention_heads": 4'
    (tmp / "hf_true.json").write_text('{"num_hidden_layers": true, ' + shape + "}")
    (tmp / "hf_tie.json").write_text('{"num_hidden_layers": 2, "tie_word_embeddings": "false", '
                                     + shape + "}")  # fmt: skip
    (tmp / "damaged" / "checkpoints" / "step_0000010").mkdir(parents=True)
    (tmp / "damaged" / "checkpoints" / "step_0000010" / "meta.json").write_text("{")
    for name, n, labels in (("gz", 4, [1, 2, 3, 4]), ("empty", 0, []), ("neglabels", 4,
                                                                         [1, -3, 2, 0])):  # fmt: skip
        d = tmp / name
        d.mkdir()
        for split in ("train", "t10k"):
            imgs = np.zeros((n, 8, 8), np.uint8)
            if name == "gz":
                idx(d / f"{split}-images-idx3-ubyte.gz", imgs, gz=True)
                idx(d / f"{split}-labels-idx1-ubyte", np.asarray(labels, np.uint8))
                continue
            idx(d / f"{split}-images-idx3-ubyte", imgs)
            lab = np.asarray(labels, np.int32)
            raw = bytes([0, 0, 0x0C, 1]) + struct.pack(">I", len(lab)) + lab.astype(">i4").tobytes()
            (d / f"{split}-labels-idx1-ubyte").write_bytes(raw)
    evil = tmp / "evil"
    evil.mkdir()
    for name in ("data_batch_1", "test_batch"):
        (evil / name).write_bytes(pickle.dumps(Evil(tmp / "PWNED")))
    good = (ROOT / "src/refdl/hw/profiles/p100-nvlink.toml").read_text()
    (tmp / "bool.toml").write_text(good.replace("devices_per_node = 8", "devices_per_node = true"))
    (tmp / "latin1.toml").write_bytes(good.replace("P100", "P100 \xe9").encode("latin-1"))
    (tmp / "log.jsonl").write_text('{"config": {"model": "mlp"}}\n{"step": "abc", "loss": 1}\n')
    (tmp / "good.jsonl").write_text('{"config": {"model": "mlp", "steps": 2}}\n'
                                    '{"step": 0, "loss": 2.3}\n{"step": 1, "loss": 2.2}\n')  # fmt: skip
    (tmp / "optstr.toml").write_text('model = "mlp"\nmodel_opts = "hidden=32"\n')
    make_foreign_inputs(tmp, good)
    make_third_look_inputs(tmp)
    head = '[recipe]\nname = "x"\n[fixed]\nmodel = "mlp"\nsteps = 2\n'
    (tmp / "negpoint.toml").write_text('[[source]]\nid = "s"\npart = "heldout"\n[[point]]\n'
                                       'source = "s"\nkind = "step"\nmetric = "step_time_s"\n'
                                       "value = -1.0\n")  # fmt: skip
    (tmp / "minmax.toml").write_text(head + "[acceptable]\nTestAccuracy = { min = 0.5, max = 0.1 }\n")
    (tmp / "min.toml").write_text(head + '[acceptable]\nTestAccuracy = { min = "high" }\n')
    (tmp / "timeout.toml").write_text(head + '[acceptable]\nTestAccuracy = { min = 0.5 }\n'
                                      '[options]\ntimeout = "long"\n')  # fmt: skip
    (tmp / "fixed.toml").write_text('fixed = 5\n[recipe]\nname = "x"\n'
                                    '[acceptable]\nTestAccuracy = { min = 0.5 }\n')  # fmt: skip
    (tmp / "section.toml").write_text(head + "[acceptable]\nTestAccuracy = { min = 0.5 }\n"
                                      "[extras]\nx = 1\n")  # fmt: skip


def make_third_look_inputs(tmp: Path) -> None:
    """Issue 54's files: a FIFO for final_params, far and long logs, odd CSVs, deep TOML."""
    config = '{"model": "mlp", "strategy": "single", "batch_size": 64'
    os.mkfifo(tmp / "fifo.npz")
    rows = "".join(f'{{"step": {t}, "loss": 2.3}}\n' for t in range(6))
    (tmp / "fifoparams.jsonl").write_text(
        f'{{"config": {config}, "steps": 6, "final_params": "fifo.npz"}}}}\n' + rows)
    (tmp / "farstep.jsonl").write_text(f'{{"config": {config}}}}}\n{{"step": 0, "loss": 2.3}}\n'
                                       '{"step": 999999999, "loss": 2.3}\n')  # fmt: skip
    (tmp / "million.jsonl").write_text(f'{{"config": {config}, "steps": 1000000}}}}\n' + rows)
    (tmp / "wide.csv").write_text(f"# config: {config}, \"steps\": 2}}\nstep,loss\n0,"
                                  + "9" * (1 << 20) + "\n")  # fmt: skip
    (tmp / "configlist.csv").write_text("# config: [1]\nstep,loss\n0,2.3\n")
    (tmp / "deep5000.toml").write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    (tmp / "emptydata.toml").write_text("")


def make_foreign_inputs(tmp: Path, profile: str) -> None:
    """Issue 32's files: special files, bombs, deep nesting, a damaged manifest."""
    import numpy as np

    for name in ("fifo", "fifo.toml", "fifo.jsonl"):
        os.mkfifo(tmp / name)
    (tmp / "fifodata").mkdir()
    os.mkfifo(tmp / "fifodata" / "ptb.train.txt")
    (tmp / "fifodata" / "ptb.test.txt").write_text("a b c\n")
    for name, labels in (("biglabels", [1, 255, 2, 0]),):
        d = tmp / name
        d.mkdir()
        for split in ("train", "t10k"):
            idx(d / f"{split}-images-idx3-ubyte", np.zeros((4, 8, 8), np.uint8))
            idx(d / f"{split}-labels-idx1-ubyte", np.asarray(labels, np.uint8))
    (tmp / "huge").mkdir()
    for split in ("train", "t10k"):
        head = bytes([0, 0, 0x08, 3]) + struct.pack(">3I", 1 << 16, 1 << 9, 1 << 9)
        (tmp / "huge" / f"{split}-images-idx3-ubyte").write_bytes(head + bytes(64))
        idx(tmp / "huge" / f"{split}-labels-idx1-ubyte", np.zeros(4, np.uint8))
    (tmp / "bomb").mkdir()
    nested: list = [0]
    for _ in range(40):  # 2**40 leaves once expanded, a few hundred bytes pickled
        nested = [nested, nested]
    for name in ("data_batch_1", "test_batch"):
        batch = {b"data": np.zeros((2, 3072), np.uint8), b"labels": nested}
        (tmp / "bomb" / name).write_bytes(pickle.dumps(batch, protocol=2))
    (tmp / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp / "deep.toml").write_text(profile + "\nextra = " + "[" * 100_000 + "]" * 100_000 + "\n")
    (tmp / "unknownkey.toml").write_text(
        profile.replace("[links.intra]\n", "[links.intra]\nbandwith = 1\n")
    )
    (tmp / "escape.toml").write_text(profile.replace('name = "', 'name = "\\u001b[31m', 1))
    ckpt = tmp / "steptrue" / "checkpoints" / "step_0000001"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text('{"format": 1, "step": true, "spec": {}, "tree_paths": [], '
                                    '"leaves": []}')  # fmt: skip
    np.savez(ckpt / "state.npz")
    (tmp / "linked").mkdir()
    (tmp / "elsewhere").mkdir()
    (tmp / "linked" / "checkpoints").symlink_to(tmp / "elsewhere")
    head = '[recipe]\nname = "x"\n[acceptable]\nTestAccuracy = { min = 0.5 }\n[fixed]\n'
    (tmp / "steplist.toml").write_text(head + 'model = "mlp"\nsteps = [1, 2]\n')
    (tmp / "oldstart").mkdir()
    (tmp / "oldstart" / "start.json").write_text('{"fingerprint": "0123456789abcdef"}')
    (tmp / "arun").mkdir()
    (tmp / "arun" / "config.json").write_text("{}")
    (tmp / "kv0.json").write_text('{"num_hidden_layers": 4, "hidden_size": 256, '
                                  '"num_attention_heads": 4, "num_key_value_heads": 0}')  # fmt: skip
    (tmp / "recipeout.toml").write_text(head + 'model = "mlp"\nout = "/tmp/another-run"\n')


def run_case(tmp: Path, module: str, args: list[str]) -> subprocess.CompletedProcess:
    args = [a.replace(T, str(tmp)) for a in args]
    if module == "refdl.train" and "--out" not in args:
        args += ["--out", str(tmp / "run")]
    return subprocess.run(
        [sys.executable, "-m", module, *args, *(["--no-progress"] if module == "refdl.train"
                                                 else [])],
        capture_output=True, text=True, timeout=300, cwd=tmp,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip


# The default run takes every twelfth case (the CLIs and the kinds of input still reached;
# every third, sixth, then eighth until 2026-11-26, when the default suite ran past its
# 15 minutes); `-m slow` runs the rest. A case costs a process start with JAX imported.
FAST = {c[0] for c in CASES[::12]}
PARAMS = [pytest.param(*c, id=c[0], marks=() if c[0] in FAST else pytest.mark.slow) for c in CASES]


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    """The selected cases, run as real processes four at a time."""
    selected = {
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "originalname", "")
        == "test_bad_input_is_one_line_exit_2_no_traceback_no_files"
    }
    cases = [c for c in CASES if c[0] in selected]
    tmp = tmp_path_factory.mktemp("bad")
    make_inputs(tmp)
    folders = {}
    for i, (name, *_rest) in enumerate(cases):
        folders[name] = tmp / f"case{i:03d}"
        folders[name].mkdir()
        for p in tmp.iterdir():  # each case sees the inputs in its own folder
            if not p.name.startswith("case"):
                (folders[name] / p.name).symlink_to(p)
    with ThreadPoolExecutor(4) as pool:
        futures = {name: pool.submit(run_case, folders[name], module, args)
                   for name, module, args, _ in cases}  # fmt: skip
        return {name: (f.result(), folders[name]) for name, f in futures.items()}, tmp


def test_at_least_sixty_cases():
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,module,args,message", PARAMS)
def test_bad_input_is_one_line_exit_2_no_traceback_no_files(results, name, module, args, message):
    (proc, folder), tmp = results[0][name], results[1]
    lines = stderr_lines(proc)
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert len(lines) == 1, "\n".join(lines[-20:])
    assert message in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    assert not (folder / "run").exists(), "a run folder was written"
    assert not (tmp / "PWNED").exists(), "code from a data file ran"
