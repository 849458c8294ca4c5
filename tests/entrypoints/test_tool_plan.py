"""tool_plan: the tools a request may give (what OpenAI refuses is refused, naming `tools`)."""
import pytest

from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.protocol import ChatCompletionRequest
from kiln.entrypoints.openai.tool_parsers.tool_plan import plan_tools


def tool(name="f", **function):
    return {"type": "function", "function": {"name": name, **function}}


def req(tools, tool_choice="required"):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools,
                                 tool_choice=tool_choice)


@pytest.mark.parametrize("tools, message", [
    ([tool("")], r"tools\[0\].function.name is empty"),
    ([tool("f"), tool(" \t")], r"tools\[1\].function.name is empty"),
    ([tool(parameters={"type": "integer"})],
     r"""tools\[0\] \(function 'f'\): parameters must be a JSON schema of type "object"""),
    ([tool(parameters={"type": ["object", "null"]})], "parameters must be"),
    ([tool(parameters={"description": "no type, no properties"})], "parameters must be"),
])
def test_tools_openai_refuses_are_400s_naming_tools(tools, message):
    for choice in ("required", "none"):
        with pytest.raises(OpenAIError, match=message) as e:
            plan_tools(req(tools, choice), "hermes", True)
        assert e.value.param == "tools" and e.value.status == 400


@pytest.mark.parametrize("parameters", [
    None, {}, {"type": "object"}, {"properties": {"a": {"type": "integer"}}}])
def test_object_parameters_or_none_are_taken(parameters):
    plan_tools(req([tool(parameters=parameters)]), None, False)


# What pydantic's model_json_schema() (and so the OpenAI SDK) writes for nested models.
CITY = {"type": "object", "properties": {"name": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["name"], "additionalProperties": False}
BOOK = tool("book", parameters={"$defs": {"City": CITY}, "type": "object",
                                "properties": {"city": {"$ref": "#/$defs/City"}},
                                "required": ["city"]})
COUNT = tool("count", parameters={"definitions": {"N": {"type": "integer"}}, "type": "object",
                                  "properties": {"n": {"$ref": "#/definitions/N"}}})


def test_required_hoists_each_tools_definitions_to_the_root():
    """Nested under the combined schema's items, "#/$defs/City" would not resolve."""
    from kiln.structured_output.xgrammar_backend import check_structured_outputs

    schema = plan_tools(req([BOOK, COUNT, BOOK]), None, False).constraint.json
    assert schema["$defs"] == {"City": CITY} and schema["definitions"] == {"N": {"type": "integer"}}
    assert all("$defs" not in o["properties"]["parameters"] for o in schema["items"]["anyOf"])
    check_structured_outputs(plan_tools(req([BOOK, COUNT]), None, False).constraint)


def test_required_refuses_two_tools_defining_one_name_differently():
    other = tool("g", parameters={"$defs": {"City": {"type": "string"}}, "type": "object"})
    with pytest.raises(OpenAIError, match=r"function 'g' defines \$defs 'City'") as e:
        plan_tools(req([BOOK, other]), None, False)
    assert e.value.param == "tools"


def test_a_tools_schema_that_does_not_compile_is_named_as_the_client_sent_it():
    import asyncio

    from kiln.entrypoints.openai.structured_fields import check_compiles

    bad = tool(parameters={"type": "object", "properties": {"a": {"type": "objectx"}}})
    plan = plan_tools(req([bad]), None, False)
    with pytest.raises(OpenAIError) as e:
        asyncio.run(check_compiles(plan.constraint, "tools"))
    assert e.value.param == "tools" and "structured_outputs" not in str(e.value)
    assert str(e.value).startswith("tools: the schema of the tools' parameters is not a JSON "
                                   "schema this server can compile: ")
