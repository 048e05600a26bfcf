"""`make serve` until the Serve app exists: one offline generation with the embedded model."""

from replica_engine import LLM, SamplingParams


def main() -> None:
    llm = LLM()
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=32, temperature=0.0),
    )
    print(out[0].text)


if __name__ == "__main__":
    main()
