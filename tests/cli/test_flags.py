"""The command line is made from RunSpec's fields (each once, with its default), and a
run's settings can come from a TOML file or a run's own ``config.json``."""

from __future__ import annotations

import dataclasses
import json
import re

from refdl.config.flags import flag_of
from refdl.config.spec import RunSpec
from refdl.train import build_parser, main


def test_help_lists_every_field_once_with_its_default():
    parser = build_parser()
    text = parser.format_help()
    actions = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(RunSpec):
        flag = flag_of(f)
        listed = re.findall(rf"^  {re.escape(flag)}(?![\w-])", text, flags=re.M)
        assert len(listed) == 1, flag  # one option line per field
        help_ = actions[f.name].help
        assert "default" in help_ or (f.default is True), (f.name, help_)
        if f.default not in (None, True, False, ()):
            assert f"default {f.default}" in help_, (f.name, help_)


def test_a_toml_file_sets_a_run_and_flags_override_it(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text('model = "mlp"\nsteps = 50\nbatch_size = 32\nlr = 0.05\n'
                    "[model_opts]\nhidden = 16\n")  # fmt: skip
    out = tmp_path / "a"
    assert main(["--config", str(toml), "--steps", "6", "--out", str(out), "--no-progress"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["model"], config["steps"], config["batch_size"], config["lr"]) == (
        "mlp", 6, 32, 0.05)  # fmt: skip
    assert config["model_opts"] == [["hidden", "16"]]
    # The run's own record is loadable by the same flag, and runs the same settings.
    again = tmp_path / "b"
    assert main(["--config", str(out / "config.json"), "--out", str(again), "--no-progress"]) == 0
    second = json.loads((again / "config.json").read_text())
    assert {k: v for k, v in second.items() if k != "out"} == {
        k: v for k, v in config.items() if k != "out"
    }
    capsys.readouterr()


def test_bad_settings_files_are_one_line_and_exit_2(tmp_path, capsys):
    typo = tmp_path / "typo.toml"
    typo.write_text("stepz = 5\n")
    writes = tmp_path / "writes.toml"
    writes.write_text('out = "runs/x"\n')
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('steps = "many"\n')
    for path, message in (
        (typo, "unknown setting 'stepz'"),
        (writes, "give --out instead"),
        (wrong, "--steps must be an integer"),
        (tmp_path / "none.toml", "none.toml"),
    ):
        folder = tmp_path / f"run_{path.stem}"
        assert main(["--config", str(path), "--out", str(folder), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not folder.exists()


def test_a_files_options_as_a_table_a_list_of_strings_or_of_pairs_are_the_same(tmp_path):
    from refdl.config.flags import file_settings

    forms = ("[model_opts]\nhidden = 16\nact = 'tanh'\n",
             "model_opts = ['hidden=16', 'act=tanh']\n",
             "model_opts = [['hidden', 16], ['act', 'tanh']]\n")  # fmt: skip
    for i, form in enumerate(forms):
        path = tmp_path / f"f{i}.toml"
        path.write_text('model = "mlp"\n' + form)
        assert file_settings(str(path))["model_opts"] == (("hidden", "16"), ("act", "tanh"))
