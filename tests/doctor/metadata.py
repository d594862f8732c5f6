"""The cloud metadata stand-in of tests/cloud, also answering each vendor's instance-type path."""

from __future__ import annotations

from tests.cloud.metadata_server import MetadataServer, Reply

INSTANCE_TYPES = {
    "aws": "p5.48xlarge",
    "gcp": "a3-highgpu-8g",
    "azure": "Standard_ND96isr_H100_v5",
    "aliyun": "ecs.gn7i-c8g1.2xlarge",
    "tencent": "GN10Xp.2XLARGE40",
}


class InstanceMetadataServer(MetadataServer):
    """Adds ``instance-type`` answers with the same header and token rules as the base."""

    def route(self, method: str, target: str, headers: dict[str, str]) -> Reply:
        path = target.split("?", 1)[0]
        if path == "/latest/meta-data/instance-type":
            ok = self._has_token("aws", headers)
            return (200, {}, INSTANCE_TYPES["aws"]) if ok else (401, {}, "Unauthorized")
        if path == "/computeMetadata/v1/instance/machine-type":
            if headers.get("metadata-flavor") != "Google":
                return 403, {}, "Missing Metadata-Flavor:Google header."
            return 200, {"Metadata-Flavor": "Google"}, f"projects/123456789/machineTypes/{INSTANCE_TYPES['gcp']}"
        if path == "/metadata/instance/compute/vmSize":
            ok = headers.get("metadata") == "true" and "api-version=" in target
            return (200, {}, INSTANCE_TYPES["azure"]) if ok else (400, {}, "Bad request")
        if path == "/latest/meta-data/instance/instance-type":
            # Alibaba Cloud hardened mode wants a token; Tencent sends none. Tell them apart by it.
            token = headers.get("x-aliyun-ecs-metadata-token")
            if token is not None:
                ok = self._has_token("aliyun", headers)
                return (200, {}, INSTANCE_TYPES["aliyun"]) if ok else (401, {}, "Unauthorized")
            return 200, {}, INSTANCE_TYPES["tencent"]
        return super().route(method, target, headers)
