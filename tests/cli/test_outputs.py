"""One output-file policy: an existing output file, or a folder holding an earlier run's results, is refused without
--force, and two outputs of one command must be distinct files (issue 27). Every check runs before any model loads."""

import pytest

from layerskip_cli.main import main
from layerskip_core.cli import check_distinct, check_output_dir, check_output_file
from layerskip_core.errors import UserError


def run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().err


def refused(code, err, message):
    assert code == 2 and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def existing(tmp_path):
    path = tmp_path / "exists.json"
    path.write_text("precious\n")
    return path


def test_an_existing_file_is_refused_unless_forced(existing):
    with pytest.raises(UserError, match="exists; pass --force"):
        check_output_file(existing, "--out", force=False)
    assert check_output_file(existing, "--out", force=True) == existing


def test_a_folder_with_earlier_results_is_refused_unless_forced(tmp_path):
    (tmp_path / "notes.txt").write_text("mine\n")
    assert check_output_dir(tmp_path, "--out", writes=("results.json",)) == tmp_path  # other files: fine
    (tmp_path / "results.json").write_text("{}\n")
    with pytest.raises(UserError, match="already holds results.json from an earlier run; pass --force"):
        check_output_dir(tmp_path, "--out", writes=("results.json", "results.md"))
    assert check_output_dir(tmp_path, "--out", writes=("results.json",), force=True) == tmp_path


@pytest.mark.parametrize("argv", [["bench", "--drafters", "autoregressive", "--data", "humaneval"],
                                  ["eval-exits", "--data", "humaneval"]])
def test_commands_refuse_to_write_over_earlier_results(capsys, tmp_path, argv):
    for name in ("results.json", "exits.json"):
        (tmp_path / name).write_text("{}\n")
    code, err = run(capsys, *argv, "--out", str(tmp_path))
    refused(code, err, "from an earlier run; pass --force")
    assert (tmp_path / "results.json").read_text() == "{}\n"


def test_two_outputs_naming_one_file_are_refused(tmp_path):
    with pytest.raises(UserError, match="--out and --counts-out are the same file"):
        check_distinct(("--out", tmp_path / "a.json"), ("--counts-out", tmp_path / "x" / ".." / "a.json"))
    check_distinct(("--out", tmp_path / "a.json"), ("--counts-out", None))


@pytest.mark.parametrize("flag", ["--out", "--counts-out"])
def test_draft_vocab_does_not_overwrite_without_force(capsys, tmp_path, existing, flag):
    other = tmp_path / "other.json"
    paths = {"--out": other, "--counts-out": other} | {flag: existing}
    paths["--counts-out" if flag == "--out" else "--out"] = other
    code, err = run(capsys, "draft-vocab", "--data", "humaneval", "--size", "64",
                    "--out", str(paths["--out"]), "--counts-out", str(paths["--counts-out"]))
    refused(code, err, f"{flag} {existing} exists; pass --force")
    assert existing.read_text() == "precious\n" and not other.exists()


def test_draft_vocab_refuses_counts_out_equal_to_out(capsys, tmp_path):
    same = tmp_path / "v.json"
    code, err = run(capsys, "draft-vocab", "--data", "humaneval", "--size", "64", "--out", str(same),
                    "--counts-out", str(same))
    refused(code, err, "--out and --counts-out are the same file")


def test_plan_import_does_not_overwrite_without_force(capsys, existing):
    refused(*run(capsys, "plan", "import", "--attn", "1", "--out", str(existing)), "exists; pass --force")
    assert existing.read_text() == "precious\n"


def test_save_plan_does_not_overwrite_without_force(capsys, existing):
    code, err = run(capsys, "generate", "--prompt", "hi", "--drafter", "swift", "--save-plan", str(existing))
    refused(code, err, f"--save-plan {existing} exists; pass --force")
    assert existing.read_text() == "precious\n"


def test_search_does_not_overwrite_its_plan_without_force(capsys, existing):
    refused(*run(capsys, "search", "--data", "humaneval", "--out", str(existing)),
            "exists; pass --resume to continue its search, or --force to overwrite it")


def test_an_output_never_writes_over_an_input_even_forced(tmp_path, existing):
    """--force overwrites an earlier output, never what the command reads: the same path, a symlink to it, a hard
    link, or a folder output that is (or is inside) an input folder or would write an input's name."""
    link, hard = tmp_path / "link.json", tmp_path / "hard.json"
    link.symlink_to(existing)
    hard.hardlink_to(existing)
    for out in (existing, link, hard, tmp_path / "." / "exists.json"):
        with pytest.raises(UserError, match="would write over --from .*which this command reads"):
            check_output_file(out, "--out", force=True, inputs=(("--from", existing),))
    assert check_output_file(existing, "--out", force=True, inputs=(("--from", tmp_path / "other.json"), ("--x", None)))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with pytest.raises(UserError, match="would write over CHECKPOINT"):
        check_output_dir(ckpt, "--out", inputs=(("CHECKPOINT", ckpt),))
    assert check_output_dir(ckpt / "exported", "--out", inputs=(("CHECKPOINT", ckpt),))  # beside, not over
    with pytest.raises(UserError, match="would write over --bench"):
        check_output_dir(tmp_path, "--out", writes=("exists.json",), force=True, inputs=(("--bench", existing),))
    assert check_output_dir(tmp_path / "new", "--out", writes=("r.json",), inputs=(("CHECKPOINT", ckpt),))


def test_plan_import_refuses_to_write_over_its_own_source(capsys, existing):
    existing.write_text('{"attention": [1], "mlp": []}')
    before = existing.read_bytes()
    code, err = run(capsys, "plan", "import", "--from", str(existing), "--out", str(existing), "--force")
    refused(code, err, f"--out {existing} would write over --from {existing}")
    assert existing.read_bytes() == before


def test_export_refuses_its_own_checkpoint_as_output(capsys, tmp_path):
    ckpt = tmp_path / "step-000001"
    ckpt.mkdir()
    code, err = run(capsys, "export", str(ckpt), "--out", str(ckpt))
    refused(code, err, "would write over CHECKPOINT")
    assert sorted(ckpt.iterdir()) == []


def test_eval_adapter_refuses_json_over_its_adapter_before_loading(capsys, tmp_path):
    import eval_adapter

    adapter = tmp_path / "adapter.safetensors"
    adapter.write_bytes(b"adapter bytes")
    code = eval_adapter.main(["--adapter", str(adapter), "--config", "no-such-recipe.yaml", "--json", str(adapter),
                              "--force"])
    refused(code, capsys.readouterr().err, "would write over --adapter")
    assert adapter.read_bytes() == b"adapter bytes"
