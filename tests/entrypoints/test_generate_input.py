"""`kiln generate`'s prompt from argv or stdin, checked before the model loads."""
import subprocess
import sys

from checkpoints import STORIES_DIR


def test_a_prompt_that_is_not_utf8_is_named_before_the_model_loads():
    """Bytes that are not UTF-8 were refused once the model had loaded, as "a lone UTF-16
    surrogate ('\\udcff')", which the user never typed; `kiln chat` names the byte (helper-106)."""
    r = subprocess.run([sys.executable, "-m", "kiln.entrypoints.cli.main", "generate", "--model",
                        str(STORIES_DIR), "--enforce-eager", "--max-model-len", "64"],
                       input=b"Tom \xff went\n", capture_output=True, timeout=300)
    err = r.stderr.decode()
    assert r.returncode == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        "error: the prompt is not UTF-8 text (byte 0xff at character 4): pass UTF-8 text")
    assert "engine core ready" not in err and "surrogate" not in err
