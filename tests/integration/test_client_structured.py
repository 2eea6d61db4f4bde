"""Structured output and tool calls as users get them from their own clients (issue 48, "Done
when"): the openai SDK's `chat.completions.parse` with a Pydantic model, `response_format`
`json_schema` (strict) and `tools` with `tool_choice="required"`, and LangChain's
`with_structured_output` and `bind_tools`, each on 20 varied prompts against a real
`conveyor serve` of the default model (SmolLM2-135M GGUF) with the model's default
sampling settings. Every answer must parse and validate: 20 of 20, no retries.

The 20 prompts of a client run at once (8 threads), as an application's users would send
them, so the constrained rows share the continuous batch."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.integration.serve_process import ServeProcess

pytestmark = [pytest.mark.model, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"

# Twenty prompts of each kind, varied in subject, length and wording (some say nothing
# about the format: the schema alone must make the answer valid).
PEOPLE = [
    "Describe a person.", "Invent a character for a detective novel.",
    "Who was Marie Curie?", "Make up a retired sailor who lives by the sea.",
    "Tell me about your best friend.", "Create a profile for a young chess prodigy.",
    "Describe a baker from Lyon, with her age and what she likes to do.",
    "A famous painter: name, age at death, and hobbies.", "Give me a random user record.",
    "Describe someone who loves hiking and cooking.", "Who is Ada Lovelace?",
    "Invent a villain for a fantasy game.", "Describe a teacher nearing retirement.",
    "Make up a teenager who plays the drums.", "Tell me about an astronaut.",
    "Describe your neighbour in one sentence.", "A gardener with three hobbies, please.",
    "Invent a pianist born in 1990.", "Describe a programmer who also surfs.",
    "Write a short bio of a fictional doctor.",
]
FILMS = [
    "Recommend a film.", "What is a good horror movie?", "Name a comedy from the 1990s.",
    "Tell me about a drama you like.", "Suggest a film for a rainy Sunday.",
    "Which movie won an award in 2005?", "A classic black-and-white film, please.",
    "I want to laugh tonight. What should I watch?", "Pick a scary film for Halloween.",
    "Describe a film about a family.", "Give me a movie released after 2010.",
    "What film would a child enjoy?", "Name one film about war.",
    "Recommend a movie set in space.", "Suggest a romantic drama.",
    "What is the funniest film you know?", "A film about a haunted house.",
    "Tell me a film with a surprise ending.", "A movie about friendship, please.",
    "Which film should everyone see once?",
]
TOOL_PROMPTS = [
    "What is the weather in Paris?", "Find news about rockets.", "Hello!",
    "Weather in Oslo in Fahrenheit?", "Search for cheap flights to Rome.",
    "Is it raining in London right now?", "Look up the population of Brazil.",
    "How cold is it in Moscow?", "Search the web for pancake recipes.",
    "Tell me a joke.", "What's the temperature in Tokyo, in Celsius?",
    "Find the latest football scores.", "Should I take an umbrella in Berlin today?",
    "Who won the chess world championship? Search it.", "Weather for Cairo please.",
    "I need hotels in Madrid.", "What is 2 + 2?", "Is it sunny in Sydney?",
    "Search for Python tutorials, 3 results.", "Forecast for New York in F.",
]
FILM_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "year": {"type": "integer", "minimum": 1890, "maximum": 2030},
        "genre": {"enum": ["drama", "comedy", "horror", "science fiction", "animation"]},
        "rating": {"type": "number", "minimum": 0, "maximum": 10},
    },
    "required": ["title", "year", "genre", "rating"],
    "additionalProperties": False,
}
# The tools' strings are bounded, as the Pydantic models' are: measured 2026-12-06 (60 runs of
# the 20 tool prompts, unbounded), the 135M model at its default temperature (0.2) writes a
# URL into search_web's query about once in 15 and repeats a path segment in it until
# max_tokens (the room of the context), which no grammar ends without a bound.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name", "maxLength": 60},
        "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}, "strict": True}}
SEARCH = {"type": "function", "function": {
    "name": "search_web", "description": "Search the web and return the top results",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "description": "The words to search for", "maxLength": 100},
        "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
        "required": ["query"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, SEARCH)}


class Person(BaseModel):
    """A person, as an application would declare one (strings bounded, as a real schema's
    are: OpenAI's strict mode has no default bound, and neither has the 135M model)."""
    name: Annotated[str, Field(max_length=50)]
    age: Annotated[int, Field(ge=0, le=130)]
    occupation: Annotated[str, Field(max_length=50)]
    hobbies: list[Annotated[str, Field(max_length=30)]] = Field(max_length=4)


class Film(BaseModel):
    title: Annotated[str, Field(max_length=60)]
    year: int
    genre: Literal["drama", "comedy", "horror", "science fiction", "animation"]


class GetWeather(BaseModel):
    """The current weather of a city."""
    city: Annotated[str, Field(description="The city's name", max_length=60)]
    unit: Literal["C", "F"]


class SearchWeb(BaseModel):
    """Search the web and return the top results."""
    query: Annotated[str, Field(description="The words to search for", max_length=100)]


@pytest.fixture(scope="module")
def server():
    s = ServeProcess("--max-num-seqs", "8").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=180)


def _each(prompts: list[str], ask: Callable[[str], Any]) -> list[tuple[str, Any]]:
    """(prompt, answer or the exception it raised) for every prompt, 8 at once."""
    def one(prompt: str) -> tuple[str, Any]:
        try:
            return prompt, ask(prompt)
        except Exception as e:  # noqa: BLE001 - reported per prompt below
            return prompt, e
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, prompts))


def _check_all(results: list[tuple[str, Any]], check: Callable[[Any], None]) -> None:
    """Runs `check` on every answer; fails listing every prompt whose answer did not pass."""
    failed = []
    for prompt, answer in results:
        try:
            if isinstance(answer, Exception):
                raise answer
            check(answer)
        except Exception as e:  # noqa: BLE001 - collected, then reported together
            failed.append(f"{prompt!r}: {type(e).__name__}: {str(e)[:300]}")
    assert not failed, f"{len(failed)} of {len(results)} failed:\n" + "\n".join(failed)


def test_openai_sdk_parse_with_a_pydantic_model(client, server):
    def ask(prompt: str):
        return client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": prompt}], response_format=Person)

    def check(done) -> None:
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Person), choice.message

    _check_all(_each(PEOPLE, ask), check)


def test_openai_sdk_json_schema_strict(client):
    def ask(prompt: str):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}],
            response_format={"type": "json_schema", "json_schema": {
                "name": "film", "schema": FILM_SCHEMA, "strict": True}})

    def check(r) -> None:
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        jsonschema.validate(json.loads(r.choices[0].message.content), FILM_SCHEMA)

    _check_all(_each(FILMS, ask), check)


def test_openai_sdk_tools_required(client):
    def ask(prompt: str):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}],
            tools=[WEATHER, SEARCH], tool_choice="required")

    def check(r) -> None:
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls, choice.message
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])

    _check_all(_each(TOOL_PROMPTS, ask), check)


@pytest.fixture(scope="module")
def chat_model(server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=server.base_url, api_key="none", max_retries=0,
                      timeout=180)


def test_langchain_with_structured_output(chat_model):
    structured = chat_model.with_structured_output(Person)

    def check(person) -> None:
        assert isinstance(person, Person), person

    _check_all(_each(PEOPLE, structured.invoke), check)


def test_langchain_bind_tools(chat_model):
    bound = chat_model.bind_tools([GetWeather, SearchWeb], tool_choice="any")
    models = {"GetWeather": GetWeather, "SearchWeb": SearchWeb}

    def check(message) -> None:
        assert not message.invalid_tool_calls, message.invalid_tool_calls
        assert message.tool_calls, message
        for call in message.tool_calls:
            models[call["name"]].model_validate(call["args"])

    _check_all(_each(TOOL_PROMPTS, bound.invoke), check)
