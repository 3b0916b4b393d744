"""The stand-in's TokensPrompt: a dict, as vLLM's is."""


def TokensPrompt(prompt_token_ids: list[int]) -> dict:  # noqa: N802 (vLLM's name)
    return {"prompt_token_ids": prompt_token_ids}
