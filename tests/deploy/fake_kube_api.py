"""A stand-in for the Kubernetes API server, on loopback: the pod list and watch of one
namespace, the two calls worker discovery makes, over plain HTTP.

The test plays the kubelet and the controllers: put() adds or changes a pod (ADDED or MODIFIED
to every watcher), delete() removes it (DELETED). A watch streams JSON lines over chunked HTTP/1.1
as the real server does; the official client reads it unchanged, configured by the kubeconfig
this writes.
"""

from __future__ import annotations

import copy
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml


class FakeKubeApi:
    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.pods: dict[str, dict] = {}
        self.version = 1
        self.events: list[tuple[int, str, dict]] = []  # (resource version, type, pod)
        self.changed = threading.Condition()
        self.requests: list[str] = []  # paths with queries, for assertions
        self.closed = False
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                api.requests.append(self.path)
                url = urllib.parse.urlparse(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                if url.path != f"/api/v1/namespaces/{api.namespace}/pods":
                    self._send(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                elif query.get("watch") in ("true", "1", "True"):
                    self._watch(query)
                else:
                    self._send(200, api._list(query.get("labelSelector", "")))

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def _watch(self, query: dict) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                since = int(query.get("resourceVersion") or 0)
                selector = query.get("labelSelector", "")
                try:
                    while True:
                        with api.changed:
                            api.changed.wait_for(lambda s=since: api.closed or any(
                                v > s for v, _, _ in api.events), timeout=1.0)
                            if api.closed:
                                break
                            new = [(v, t, p) for v, t, p in api.events if v > since]
                        for version, kind, pod in new:
                            since = version
                            if _selects(selector, pod):
                                self._chunk(json.dumps({"type": kind, "object": pod}).encode()
                                            + b"\n")
                    self._chunk(b"")
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _list(self, selector: str) -> dict:
        with self.changed:
            items = [copy.deepcopy(p) for p in self.pods.values() if _selects(selector, p)]
            return {"kind": "PodList", "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self.version)}, "items": items}

    def _record(self, kind: str, pod: dict) -> None:
        with self.changed:
            self.version += 1
            pod = copy.deepcopy(pod)
            pod["metadata"]["resourceVersion"] = str(self.version)
            if kind == "DELETED":
                self.pods.pop(pod["metadata"]["name"], None)
            else:
                self.pods[pod["metadata"]["name"]] = pod
            self.events.append((self.version, kind, pod))
            self.changed.notify_all()

    def put(self, pod: dict) -> None:
        name = pod["metadata"]["name"]
        self._record("MODIFIED" if name in self.pods else "ADDED", pod)

    def delete(self, name: str) -> None:
        if name in self.pods:
            self._record("DELETED", self.pods[name])

    def write_kubeconfig(self, path: Path) -> str:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "fake", "user": {"token": "fake"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake",
                                                      "namespace": self.namespace}}],
        }
        path.write_text(yaml.safe_dump(config))
        return str(path)

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify_all()
        self.server.shutdown()
        self.server.server_close()


def _selects(selector: str, pod: dict) -> bool:
    labels = pod["metadata"].get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


def worker_pod(name: str, namespace: str, labels: dict, grpc_port: int, zmq_port: int,
               ready: bool = True, deleting: bool = False, ip: str = "127.0.0.1",
               phase: str = "Running", tensor_parallel_size: int = 1) -> dict:
    """A worker pod as the API server would show it, at the ports a local worker bound."""
    meta = {"name": name, "namespace": namespace, "uid": f"uid-{name}", "labels": dict(labels),
            "annotations": {"batchwire.io/tensor-parallel-size": str(tensor_parallel_size)}}
    if deleting:
        meta["deletionTimestamp"] = "2030-01-01T00:00:00Z"
    status: dict = {"phase": phase, "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    ports = [{"name": "grpc", "containerPort": grpc_port},
             {"name": "zmq", "containerPort": zmq_port}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "worker", "ports": ports}]}, "status": status}
