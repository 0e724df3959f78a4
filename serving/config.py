"""Settings for the serving gateway."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServingSettings(_Section):
    """The OpenAI-compatible gateway."""

    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(8000, ge=0, le=65535, description="Bind port (0 = pick a free one).")
    engine: Literal["torch", "vllm"] = Field("torch", description="Inference engine.")
    feedback_secret: SecretStr = Field(SecretStr("change-me-in-production"),
                                       description="HMAC key for feedback tokens. Never logged.")
    api_keys_file: str = Field("var/api_keys.json", description="Hashed API keys (see `rtrl keys add`).")
