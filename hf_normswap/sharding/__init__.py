"""Training sharded across processes with FSDP2: the options a healing and a comparison share, and the sharding."""

from .options import ShardingOptions


__all__ = ["ShardingOptions"]
