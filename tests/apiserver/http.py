"""The HTTP side: URL routing, content negotiation (JSON / Table), list paging, watch streaming."""
from __future__ import annotations

import base64
import json
import time
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlsplit

from tests.apiserver import (
    context,
    discovery,
    eviction,
    openapi,
    protobuf,
    tables,
)
from tests.apiserver.errors import ApiError, bad_request, gone, method_not_allowed
from tests.apiserver.selectors import FieldSelector, LabelSelector


def _dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class RequestInfo:
    """What ``ApiServer.request_counts_by`` hands its key function."""
    __slots__ = (
        "code",
        "group",
        "method",
        "name",
        "namespace",
        "path",
        "query",
        "resource",
        "subresource",
        "user_agent",
        "verb",
        "version",
    )

    def __init__(self, method, path, query, user_agent):
        self.method, self.path, self.query, self.user_agent = method, path, query, user_agent
        self.verb = self.group = self.version = self.resource = self.subresource = self.namespace = self.name = ""
        self.code = 0

    def __repr__(self):
        return f"<{self.method} {self.path} verb={self.verb} resource={self.resource} code={self.code}>"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "driverd-sim-apiserver"
    sys_version = ""

    def log_message(self, fmt, *args):  # quiet
        pass

    def setup(self):
        super().setup()
        self.server.api.track(self.connection, True)

    def finish(self):
        try:
            super().finish()
        finally:
            self.server.api.track(self.connection, False)

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_PATCH(self):
        self._dispatch("PATCH")

    def do_DELETE(self):
        self._dispatch("DELETE")

    # ------------------------------------------------------------------ plumbing
    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            return self.rfile.read(n)
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            out = b""
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0] or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        return b""

    def _json_body(self) -> dict:
        raw = self._body()
        ct = (self.headers.get("Content-Type") or "application/json").split(";")[0].strip()
        if ct == "application/vnd.kubernetes.protobuf":
            decoded = protobuf.decode(raw)
            if decoded is not None:
                return decoded
            raise ApiError(415, "UnsupportedMediaType", "the body of the request was in an unknown format - accepted "
                           "media types include: application/json, application/yaml (the simulated API server decodes "
                           "protobuf only for ConfigMap, Secret, Namespace and ServiceAccount)")
        try:
            if ct in ("application/yaml", "application/apply-patch+yaml"):
                import yaml
                return yaml.safe_load(raw)
            return json.loads(raw or b"{}")
        except ValueError as e:
            raise bad_request(f"error decoding request body: {e}") from None

    def _send(self, code: int, body, ctype: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else _dumps(body)
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-cache, private")
        self.end_headers()
        self.wfile.write(data)
        self._info.code = code

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        q = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        self._info = RequestInfo(method, url.path, q, self.headers.get("User-Agent", ""))
        self.server.api._count(self._info)
        context.set_field_validation(q.get("fieldValidation"))
        try:
            self._route(method, url.path.rstrip("/") or "/", q)
        except ApiError as e:
            self._send(e.code, e.status())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - a server answers 500, as Kubernetes does
            err = ApiError(500, "InternalError", f"Internal error occurred: {type(e).__name__}: {e}")
            try:
                self._send(500, err.status())
            except OSError:
                self.close_connection = True

    # ------------------------------------------------------------------ routes
    def _route(self, method: str, path: str, q: dict) -> None:
        api = self.server.api
        reg = api.store.registry
        parts = [p for p in path.split("/") if p]
        if method == "GET":
            if path == "/version":
                return self._send(200, discovery.VERSION)
            if path in ("/healthz", "/readyz", "/livez"):
                return self._send(200, b"ok", "text/plain; charset=utf-8")
            if path == "/api":
                return self._send(200, discovery.api_versions(f"{api.host}:{api.port}"))
            if path == "/apis":
                return self._send(200, discovery.api_group_list(reg))
            if path == "/api/v1":
                return self._send(200, discovery.resource_list(reg, "v1"))
            if len(parts) == 2 and parts[0] == "apis":
                doc = discovery.api_group(reg, parts[1])
                if doc:
                    return self._send(200, doc)
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            if len(parts) == 3 and parts[0] == "apis":
                doc = discovery.resource_list(reg, f"{parts[1]}/{parts[2]}")
                if doc:
                    return self._send(200, doc)
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            if parts[:2] == ["openapi", "v3"]:
                return self._openapi("/".join(parts[2:]))
        if parts[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", parts[2:]
        elif parts and parts[0] == "apis" and len(parts) >= 4:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        watch_path = False
        if rest and rest[0] == "watch":
            watch_path, rest = True, rest[1:]
        ns = ""
        if len(rest) >= 3 and rest[0] == "namespaces" and not (len(rest) == 3 and rest[2] in ("status", "finalize")):
            ns, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        gv = f"{group}/{version}" if group else version
        res = reg.lookup(gv, rest[0])
        if res is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        name = rest[1] if len(rest) > 1 else ""
        sub = rest[2] if len(rest) > 2 else ""
        info = self._info
        info.group, info.version, info.resource, info.subresource, info.namespace, info.name = \
            group, version, res.plural, sub, ns, name
        if ns and not res.namespaced:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        store = api.store
        dry = q.get("dryRun") == "All"
        if sub and not (sub == "status" and res.status) and not (sub == "eviction" and res.plural == "pods"
                                                                   and res.group == ""):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if method == "GET":
            if name:
                if q.get("watch") in ("true", "1") or watch_path:
                    info.verb = "watch"
                    fs = FieldSelector.parse(f"metadata.name={name}")
                    return self._watch(res, ns, q, fs_extra=fs)
                info.verb = "get"
                obj = store.get_raw(res, name, ns)
                if self._wants_table():
                    return self._send(200, tables.table(res, [obj], include_object=q.get("includeObject",
                                                                                          "Metadata"),
                                                        rv=store.resource_version))
                return self._send(200, obj)
            if q.get("watch") in ("true", "1") or watch_path:
                info.verb = "watch"
                return self._watch(res, ns, q)
            info.verb = "list"
            return self._list(res, ns, q)
        if method == "POST":
            if sub == "eviction":
                info.verb = "create"
                body = self._json_body()
                return self._send(201, eviction.evict(store, ns, name, body, dry_run=dry))
            if name:
                raise method_not_allowed()
            info.verb = "create"
            obj = store.create(res, self._json_body(), ns or None, dry_run=dry)
            return self._send(201, obj)
        if method == "PUT":
            if not name:
                raise method_not_allowed()
            info.verb = "update"
            body = self._json_body()
            obj = store.update(res, body, ns or None, subresource=sub or None, name=name, dry_run=dry)
            return self._send(200, obj)
        if method == "PATCH":
            if not name:
                raise method_not_allowed()
            info.verb = "patch"
            ctype = self.headers.get("Content-Type") or ""
            body = self._body()
            try:
                obj = store.patch(res, name, body, ctype, ns or None, subresource=sub or None, dry_run=dry)
            except ApiError as e:
                if e.code == 404 and ctype.startswith("application/apply-patch") and not sub:
                    import yaml
                    doc = yaml.safe_load(body)
                    doc.setdefault("metadata", {})["name"] = name
                    obj = store.create(res, doc, ns or None, dry_run=dry)
                    return self._send(201, obj)
                raise
            return self._send(200, obj)
        if method == "DELETE":
            opts = {}
            if int(self.headers.get("Content-Length") or 0):
                opts = self._json_body() or {}
            grace = q.get("gracePeriodSeconds", opts.get("gracePeriodSeconds"))
            pre = opts.get("preconditions") or {}
            if not name:
                info.verb = "deletecollection"
                items, _ = store.snapshot(res, ns or None, q.get("labelSelector"),
                                           self._field_selector(res, q), copies=False)
                deleted = []
                for o in items:
                    try:
                        deleted.append(store.delete(res, o["metadata"]["name"], o["metadata"].get("namespace"),
                                                    grace_period_seconds=_int(grace), dry_run=dry))
                    except ApiError:
                        pass
                return self._send(200, {"kind": res.list_kind, "apiVersion": res.api_version,
                                        "metadata": {"resourceVersion": store.resource_version}, "items": deleted})
            info.verb = "delete"
            obj = store.delete(res, name, ns or None, grace_period_seconds=_int(grace), uid=pre.get("uid"),
                               resource_version=pre.get("resourceVersion"), dry_run=dry)
            if res.plural == "pods" and res.group == "" or obj["metadata"].get("deletionTimestamp") and \
                    obj["metadata"].get("finalizers") or res.crd is not None:
                return self._send(200 if not obj["metadata"].get("finalizers") else 202, obj)
            return self._send(200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                    "details": {"name": name, **({"group": res.group} if res.group else {}),
                                                "kind": res.plural, "uid": obj["metadata"].get("uid")}})
        raise method_not_allowed()

    def _wants_table(self) -> bool:
        accept = self.headers.get("Accept") or ""
        return "as=Table" in accept

    def _field_selector(self, res, q):
        if not q.get("fieldSelector"):
            return None
        return FieldSelector.parse(q["fieldSelector"], res.group, res.plural,
                                   self.server.api.store.behaviors.extra_fields(res))

    def _list(self, res, ns: str, q: dict) -> None:
        store = self.server.api.store
        ls = LabelSelector.parse(q.get("labelSelector"))
        fs = self._field_selector(res, q)
        items, rv = store.snapshot(res, ns or None, ls, fs, copies=False)
        limit = _int(q.get("limit")) or 0
        cont, remaining = "", None
        if q.get("continue"):
            try:
                tok = json.loads(base64.urlsafe_b64decode(q["continue"] + "==="))
                start, rv = tuple(tok["start"]), tok["rv"]
            except (ValueError, KeyError, TypeError):
                raise bad_request("continue key is not valid: illegal base64 data") from None
            if int(rv) < store._compacted_rv:
                raise gone("The provided continue parameter is too old to display a consistent list result. You "
                           "can start a new list without the continue parameter.")
            items = [o for o in items if (o["metadata"].get("namespace", ""), o["metadata"]["name"]) > start]
        if limit and len(items) > limit:
            last = items[limit - 1]["metadata"]
            cont = base64.urlsafe_b64encode(_dumps({"rv": rv, "start": [last.get("namespace", ""), last["name"]]})
                                            ).decode().rstrip("=")
            remaining = len(items) - limit
            items = items[:limit]
        if self._wants_table():
            return self._send(200, tables.table(res, items, include_object=q.get("includeObject", "Metadata"), rv=rv,
                                                cont=cont, remaining=remaining))
        md = {"resourceVersion": rv}
        if cont:
            md["continue"] = cont
            md["remainingItemCount"] = remaining
        kind, version = res.list_kind, res.api_version
        if "as=PartialObjectMetadataList" in (self.headers.get("Accept") or ""):
            # as kube-apiserver answers it: each item's kind, apiVersion and metadata alone
            kind, version, items = "PartialObjectMetadataList", "meta.k8s.io/v1", [tables.partial(o) for o in items]
        body = b'{"kind":"%s","apiVersion":"%s","metadata":%s,"items":[%s]}' % (
            kind.encode(), version.encode(), _dumps(md), b",".join(_dumps(o) for o in items))
        self._send(200, body)

    def _openapi(self, rest: str) -> None:
        api = self.server.api
        reg = api.store.registry
        vendored = set(openapi.vendored_paths())
        gvs = reg.group_versions()
        if rest == "":
            paths = {}
            for gv in sorted(gvs):
                p = f"api/{gv}" if "/" not in gv else f"apis/{gv}"
                if p in vendored:
                    paths[p] = {"serverRelativeURL": f"/openapi/v3/{p}?hash={openapi.etag(p)}"}
                else:
                    doc = self._generated(gv, gvs[gv])
                    import hashlib
                    paths[p] = {"serverRelativeURL": f"/openapi/v3/{p}?hash="
                                f"{hashlib.sha512(doc).hexdigest().upper()}"}
            return self._send(200, {"paths": paths})
        if rest in vendored:
            return self._send(200, openapi.raw(rest))
        gv = rest[4:] if rest.startswith("api/") else rest[5:] if rest.startswith("apis/") else ""
        if gv in gvs:
            return self._send(200, self._generated(gv, gvs[gv]))
        raise ApiError(404, "NotFound", "the server could not find the requested resource")

    def _generated(self, gv: str, rs: dict) -> bytes:
        group, _, version = gv.rpartition("/")
        return openapi.generated(group, version, sorted(rs.values(), key=lambda r: r.plural))

    # ------------------------------------------------------------------ watch
    def _watch(self, res, ns: str, q: dict, fs_extra=None) -> None:
        api = self.server.api
        store = api.store
        ls = LabelSelector.parse(q.get("labelSelector"))
        fs = self._field_selector(res, q)
        if fs_extra is not None:
            fs = FieldSelector((fs.reqs if fs else []) + fs_extra.reqs)
        rv = q.get("resourceVersion")
        send_initial = None
        if q.get("sendInitialEvents") == "true":
            send_initial = True
        elif q.get("sendInitialEvents") == "false":
            send_initial = False
        table = self._wants_table()
        include = q.get("includeObject", "Metadata")
        timeout = _int(q.get("timeoutSeconds"))
        bookmarks = q.get("allowWatchBookmarks") in ("true", "1")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache, private")
        self.end_headers()
        self._info.code = 200
        try:
            w = store.watch(res, ns or None, rv, ls if not ls.empty() else None, fs, send_initial=send_initial)
        except ApiError as e:
            self._chunk(_dumps({"type": "ERROR", "object": e.status()}) + b"\n")
            self._chunk(b"")
            return
        api._watch_opened(w)
        headers = True
        initial_pending = bool(send_initial) and bookmarks
        deadline = time.monotonic() + timeout if timeout else None
        next_bookmark = time.monotonic() + api.bookmark_interval
        try:
            while True:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    break
                wait = next_bookmark - now
                if deadline is not None:
                    wait = min(wait, deadline - now)
                if initial_pending and not w.pending():
                    wait = 0
                item = w.next(timeout=max(0.0, wait))
                if item is None:
                    if bookmarks and (initial_pending or time.monotonic() >= next_bookmark):
                        brv = store.bookmark_rv(w)
                        if brv is not None:
                            md = {"resourceVersion": brv}
                            if initial_pending:
                                md["annotations"] = {"k8s.io/initial-events-end": "true"}
                                initial_pending = False
                            self._chunk(_dumps({"type": "BOOKMARK", "object": {
                                "kind": res.kind, "apiVersion": res.api_version, "metadata": md}}) + b"\n")
                        next_bookmark = time.monotonic() + api.bookmark_interval
                    continue
                typ, obj = item
                if typ == "CLOSED":
                    break
                if table:
                    obj = tables.table(res, [obj], include_object=include, headers=headers)
                    headers = False
                self._chunk(b'{"type":"%s","object":%s}\n' % (typ.encode(), _dumps(obj)))
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.close_connection = True
        finally:
            w.stop()
            api._watch_closed(w)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


def _int(v):
    if v is None or v == "":
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        raise bad_request(f"invalid integer: {v}") from None
