"""A device's compiled files (QNN's EPContext model, Vela's TFLite) committed after the model:
renamed into place, or one line when a destination cannot be written; the staging directory
goes either way (opfuse.save.commit_staged_files)."""

import pytest

from opfuse.errors import OpfuseError
from opfuse.save import commit_staged_files


def _staged(tmp_path):
    staging = tmp_path / ".opfuse-stage"
    staging.mkdir()
    (staging / "a.bin").write_bytes(b"first")
    (staging / "b.bin").write_bytes(b"second")
    return staging


def test_files_are_renamed_into_place_and_the_staging_directory_goes(tmp_path):
    staging = _staged(tmp_path)
    commit_staged_files(staging, [("a.bin", tmp_path / "m.tflite"), (staging / "b.bin", tmp_path / "m_vela.tflite")])
    assert (tmp_path / "m.tflite").read_bytes() == b"first"
    assert (tmp_path / "m_vela.tflite").read_bytes() == b"second"
    assert not staging.exists()


def test_a_destination_that_cannot_be_written_is_one_line_and_nothing_is_left(tmp_path):
    staging = _staged(tmp_path)
    missing = tmp_path / "no-such-dir" / "m_vela.tflite"
    with pytest.raises(OpfuseError) as raised:
        commit_staged_files(staging, [("a.bin", missing)])
    message = str(raised.value)
    assert message.startswith(str(missing)) and "cannot write" in message and "\n" not in message
    assert not staging.exists() and not missing.parent.exists()
