"""A small Hugging Face hub on 127.0.0.1 for tests: the endpoints
``huggingface_hub`` 2.x calls to download a repo, served from memory.

Repos are added from local directories (e.g. a tiny checkpoint written by
:func:`mlx_spec.testing.checkpoints.write_tiny_checkpoint`); each gets one
commit whose sha is a hash of its files. Clients reach the hub through
``HF_ENDPOINT=hub.url`` (read by ``huggingface_hub`` when it is imported, so
tests run the client in a subprocess or set it before importing).

Served:

- ``GET /api/models/{repo}/revision/{rev}``: ``id``, ``sha``, ``siblings``;
- ``GET /api/models/{repo}/tree/{rev}[/{path}]``: the file listing;
- ``HEAD`` / ``GET /{repo}/resolve/{rev}/{file}``: ``X-Repo-Commit``,
  ``ETag``, ``Content-Length``, ``Accept-Ranges``; a ``Range: bytes=a-b``
  request gets ``206`` with ``Content-Range``;
- errors as the hub sends them: ``404`` with ``X-Error-Code`` ``RepoNotFound``,
  ``RevisionNotFound`` or ``EntryNotFound``.

Switches for failure tests: ``refuse_ranges`` (answer every ``Range`` request
with the whole file, ``200``, as a server without range support does) and
``die_after`` (close the connection after that many body bytes of any file
whose name contains ``die_on``). ``bytes_sent`` counts the file bytes sent
per ``(repo, file)``; ``requests`` records ``(method, path, range)``.
"""

import hashlib
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, List, Optional, Tuple
from urllib.parse import unquote, urlsplit

_REVISION = re.compile(r"^/api/models/(.+?)/revision/([^/]+)$")
_TREE = re.compile(r"^/api/models/(.+?)/tree/([^/]+)(?:/(.*))?$")
_RESOLVE = re.compile(r"^/(.+?)/resolve/([^/]+)/(.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class _Repo:
    def __init__(self, files: Dict[str, bytes], branch: str):
        self.files = files
        digest = hashlib.sha1()
        for name in sorted(files):
            digest.update(name.encode() + b"\0" + hashlib.sha1(files[name]).digest())
        self.sha = digest.hexdigest()
        self.refs = {branch: self.sha}
        self.oids = {n: hashlib.sha1(b).hexdigest() for n, b in files.items()}

    def commit(self, revision: str) -> Optional[str]:
        if revision == self.sha:
            return self.sha
        return self.refs.get(revision)


class FakeHub:
    """A hub serving repos from memory on ``127.0.0.1`` (a free port).

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self):
        self.repos: Dict[str, _Repo] = {}
        self.refuse_ranges = False
        self.die_after: Optional[int] = None
        self.die_on = ""
        self.bytes_sent: Dict[Tuple[str, str], int] = {}
        self.requests: List[Tuple[str, str, Optional[str]]] = []
        self._lock = threading.Lock()
        self._server: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------ repos

    def add_repo(self, repo_id: str, directory, branch: str = "main") -> str:
        """Serve every file under ``directory`` as ``repo_id``; returns its commit sha."""
        root = Path(directory)
        files = {
            p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*"))
            if p.is_file()
        }
        repo = _Repo(files, branch)
        self.repos[repo_id] = repo
        return repo.sha

    def sent(self, repo_id: str, filename: Optional[str] = None) -> int:
        """File bytes sent for ``repo_id`` (one file, or all of them)."""
        with self._lock:
            return sum(
                n
                for (r, f), n in self.bytes_sent.items()
                if r == repo_id and (filename is None or f == filename)
            )

    def reset_counts(self):
        with self._lock:
            self.bytes_sent.clear()
            self.requests.clear()

    # ----------------------------------------------------------- server

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the fake hub is not running")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "FakeHub":
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="fake-hub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self):
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=30)
            self._server = self._thread = None

    def __enter__(self) -> "FakeHub":
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        # A client hanging up mid-file is what the die switch and the
        # refused ranges test; anything else is a bug of the fake hub.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet: tests read the counters instead
        pass

    def do_GET(self):
        self._serve(body=True)

    def do_HEAD(self):
        self._serve(body=False)

    # -------------------------------------------------------------- routes

    def _serve(self, body: bool):
        path = unquote(urlsplit(self.path).path)
        with self.hub._lock:
            self.hub.requests.append((self.command, path, self.headers.get("Range")))
        for pattern, route in (
            (_REVISION, self._revision),
            (_TREE, self._tree),
            (_RESOLVE, self._resolve),
        ):
            match = pattern.match(path)
            if match:
                return route(body, *match.groups())
        self._error(404, "EntryNotFound", f"no route {path}", body)

    def _find(self, repo_id: str, revision: str, body: bool):
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository {repo_id} not found", body)
            return None, None
        sha = repo.commit(revision)
        if sha is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", body)
            return None, None
        return repo, sha

    def _revision(self, body: bool, repo_id: str, revision: str):
        repo, sha = self._find(repo_id, revision, body)
        if repo is None:
            return
        siblings = [{"rfilename": n, "size": len(b)} for n, b in repo.files.items()]
        self._json({"id": repo_id, "sha": sha, "siblings": siblings}, body)

    def _tree(self, body: bool, repo_id: str, revision: str, under: Optional[str]):
        repo, sha = self._find(repo_id, revision, body)
        if repo is None:
            return
        prefix = (under.rstrip("/") + "/") if under else ""
        entries = [
            {"type": "file", "path": n, "size": len(b), "oid": repo.oids[n]}
            for n, b in sorted(repo.files.items())
            if n.startswith(prefix)
        ]
        self._json(entries, body)

    def _resolve(self, body: bool, repo_id: str, revision: str, filename: str):
        repo, sha = self._find(repo_id, revision, body)
        if repo is None:
            return
        data = repo.files.get(filename)
        if data is None:
            self._error(404, "EntryNotFound", f"{filename} not found", body)
            return
        start, end, status = 0, len(data), 200
        wanted = self.headers.get("Range")
        if wanted and not self.hub.refuse_ranges:
            match = _RANGE.match(wanted.strip())
            if match is None or int(match.group(1)) >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start = int(match.group(1))
            end = min(int(match.group(2)) + 1, len(data)) if match.group(2) else end
            status = 206
        self.send_response(status)
        self.send_header("X-Repo-Commit", sha)
        self.send_header("ETag", f'"{repo.oids[filename]}"')
        self.send_header("Accept-Ranges", "none" if self.hub.refuse_ranges else "bytes")
        self.send_header("Content-Length", str(end - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.end_headers()
        if body:
            self._send_file(repo_id, filename, data[start:end])

    def _send_file(self, repo_id: str, filename: str, chunk: bytes):
        hub = self.hub
        limit = len(chunk)
        if hub.die_after is not None and hub.die_on in filename:
            limit = min(limit, hub.die_after)
        self.wfile.write(chunk[:limit])
        self.wfile.flush()
        with hub._lock:
            key = (repo_id, filename)
            hub.bytes_sent[key] = hub.bytes_sent.get(key, 0) + limit
        if limit < len(chunk):  # die mid-file: the client sees a short body
            self.close_connection = True
            self.connection.shutdown(2)

    # ------------------------------------------------------------- replies

    def _json(self, value, body: bool):
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str, body: bool):
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)
