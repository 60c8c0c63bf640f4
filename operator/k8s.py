"""The only module that calls the Kubernetes API: a small JSON client over aiohttp.

Credentials come from kubernetes_asyncio's loaders (in-cluster service account, or a
kubeconfig with token refresh and exec plugins); every request is counted per verb so the
benchmark and the operator's /metrics can tell reads from writes.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections import Counter
from typing import Any

import aiohttp
from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client import Configuration

from pagedinfer.operator.errors import ApiError
from pagedinfer.operator.resources import CRD, Resource

MERGE_PATCH = "application/merge-patch+json"
WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


async def load_configuration() -> Configuration:
    """In-cluster credentials when running in a pod, else the current kubeconfig context."""
    configuration = Configuration()
    try:
        kube_config.load_incluster_config(client_configuration=configuration)
    except kube_config.ConfigException:
        await kube_config.load_kube_config(client_configuration=configuration)
    return configuration


class KubeClient:
    """JSON requests to the API server; raises ApiError, returns None for 404 on reads."""

    def __init__(
        self, configuration: Configuration, *, timeout_seconds: float = 30.0, keepalive: bool = True
    ) -> None:
        self._keepalive = keepalive
        self._configuration = configuration
        self._base = configuration.host.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        self.calls: Counter[str] = Counter()  # verb -> count

    @property
    def num_writes(self) -> int:
        return sum(n for verb, n in self.calls.items() if verb in WRITE_VERBS)

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _ssl(self) -> ssl.SSLContext | bool:
        cfg = self._configuration
        if not self._base.startswith("https"):
            return False
        context = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
        if cfg.cert_file:
            context.load_cert_chain(cfg.cert_file, keyfile=cfg.key_file)
        if not cfg.verify_ssl:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context

    async def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        auth = (await self._configuration.auth_settings()).get("BearerToken")
        if auth and auth.get("value"):
            headers["Authorization"] = auth["value"]
        return headers

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str | None = None,
    ) -> Any:
        """One API call; returns the decoded JSON or raises ApiError (status 0: no response)."""
        if self._closed:
            raise ApiError(0, f"{method} {path}: the client is closed (operator stopping)", reason="Closed")
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._ssl(), limit=64, force_close=not self._keepalive)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        data = None if body is None else json.dumps(body)
        ctype = content_type or ("application/json" if body is not None else None)
        self.calls[method] += 1
        try:
            headers = await self._headers(ctype)
            async with self._session.request(
                method, self._base + path, data=data, params=params, headers=headers
            ) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise _api_error(resp.status, text)
                return json.loads(text) if text else None
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise ApiError(0, f"{method} {path}: {exc!r}", reason="Unreachable") from exc

    async def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", resource.path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, resource: Resource, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        found = await self.request("GET", resource.path(namespace), params={"labelSelector": label_selector})
        return list((found or {}).get("items") or [])

    async def create(self, resource: Resource, body: dict[str, Any]) -> dict[str, Any]:
        return await self.request("POST", resource.path(body["metadata"]["namespace"]), body=body)

    async def patch(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        patch: dict[str, Any],
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """A JSON merge patch (lists are replaced whole: the operator owns the lists it renders)."""
        path = resource.path(namespace, name, subresource)
        return await self.request("PATCH", path, body=patch, content_type=MERGE_PATCH)

    async def delete(self, resource: Resource, namespace: str, name: str) -> bool:
        """Delete in the background (dependents go with it); False when it was already gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        try:
            await self.request("DELETE", resource.path(namespace, name), body=body)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def crd_exists(self, crd_name: str) -> bool:
        try:
            await self.request("GET", f"/apis/{CRD.group}/{CRD.version}/{CRD.plural}/{crd_name}")
        except ApiError as exc:
            if exc.status in (403, 404):
                return False
            raise
        return True


def _api_error(status: int, text: str) -> ApiError:
    try:
        payload = json.loads(text)
    except ValueError:
        payload = {}
    if not isinstance(payload, dict):
        payload = {}
    return ApiError(
        status, str(payload.get("message") or text[:300]), reason=str(payload.get("reason") or "")
    )
