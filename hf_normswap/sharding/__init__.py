"""Training sharded across processes with FSDP2: the options a healing and a comparison share (`options`), the
launch's processes (`processes`), the sharding (`fsdp`) and the workarounds of private internals it needs
(`private_internals`)."""

from .options import ShardingOptions, flat_settings, sharding_section, with_sharding_section


__all__ = ["ShardingOptions", "flat_settings", "sharding_section", "with_sharding_section"]
