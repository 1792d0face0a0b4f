"""Launch hygiene with real processes: a reader that goes away, the local launcher killed, what a run
leaves in /tmp, the roll call's identity checks, a foreign listener on MASTER_PORT, unknown variables."""
import json
import subprocess
import sys

from conftest import SCRIPT, clean_env


def test_dead_stdout_never_stops_the_run(tmp_path):
    """Local mode piped into `head -3`: no traceback, the JSON is written, the exit code is the verdict."""
    jp = tmp_path / "v.json"
    tool = subprocess.Popen([sys.executable, str(SCRIPT), "--nproc", "2", "--skip-screen", "--json", str(jp)],
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = subprocess.run(["head", "-3"], stdin=tool.stdout, capture_output=True, timeout=300)
    tool.stdout.close()
    _, err = tool.communicate(timeout=300)
    err = err.decode(errors="replace")
    assert len(head.stdout.decode().splitlines()) == 3
    assert tool.returncode == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert json.loads(jp.read_text())["verdict"] == "PASS"
