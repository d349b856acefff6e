"""The launcher's small pieces: the admin password file and the console's external address.

`inferops run` itself (the password printed twice, the file, alert links on --port) is in
tests/test_launcher.py.
"""

from __future__ import annotations

from project.bootstrap import save_admin_password
from project.launcher import external_url


def test_password_file_is_readable_by_its_owner_only(tmp_path):
    stale = tmp_path / "admin-password"
    stale.write_text("old")
    stale.chmod(0o644)  # left from an earlier database
    path = save_admin_password(tmp_path, "s3cret-pw")
    assert path == stale and path.stat().st_mode & 0o777 == 0o600
    assert "username: admin\npassword: s3cret-pw\n" in path.read_text()


def test_external_url_is_the_address_the_console_was_started_on():
    assert external_url("127.0.0.1", 9001) == "http://127.0.0.1:9001"
    assert external_url("ops.example", 80) == "http://ops.example:80"
    assert external_url("::1", 8000) == "http://[::1]:8000"
    wildcard = external_url("0.0.0.0", 8000)
    assert wildcard.endswith(":8000") and "0.0.0.0" not in wildcard
