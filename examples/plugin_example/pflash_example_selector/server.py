"""The plugin's server side: one route that reports the selections the recency selector made."""
from __future__ import annotations

from fastapi import APIRouter

from . import SELECTIONS

router = APIRouter()
routers = [router]


@router.get("/example/selections")
async def selections() -> dict:
    return {"count": len(SELECTIONS), "last": SELECTIONS[-1] if SELECTIONS else None}
