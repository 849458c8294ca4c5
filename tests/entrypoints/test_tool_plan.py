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
    None, {}, {"type": "object"}, {"properties": {"a": {"type": "integer"}}},
    {"type": ["object"]},
    # pydantic's schema of a recursive model: a root $ref (helper-44)
    {"$defs": {"T": {"type": "object", "properties": {"c": {"type": "array", "items": {
        "$ref": "#/$defs/T"}}}}}, "$ref": "#/$defs/T"},
    {"anyOf": [{"type": "object"}, {"properties": {"b": {"type": "string"}}}]}])
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


def test_required_rebases_each_tools_references_under_its_own_place():
    """Nested under the combined schema's items, "#/$defs/City" would not resolve, and "#" (a
    recursive schema) pointed at the combined array (helper-44); two tools may define one name
    differently."""
    from kiln.structured_output.xgrammar_backend import check_structured_outputs

    tree = tool("tree", parameters={"type": "object", "properties": {
        "children": {"type": "array", "items": {"$ref": "#"}}, "enum_data": {
            "enum": [{"$ref": "#"}]}}})
    other = tool("g", parameters={"$defs": {"City": {"type": "string"}}, "type": "object",
                                  "properties": {"c": {"$ref": "#/$defs/City"}}})
    schema = plan_tools(req([BOOK, COUNT, tree, other]), None, False).constraint.json
    defs = schema["$defs"]
    assert [o["properties"]["parameters"] for o in schema["items"]["anyOf"]] == [
        {"$ref": f"#/$defs/kiln_tool_{i}"} for i in range(4)]
    assert defs["kiln_tool_0"]["properties"]["city"] == {"$ref": "#/$defs/kiln_tool_0/$defs/City"}
    assert defs["kiln_tool_1"]["properties"]["n"] == {
        "$ref": "#/$defs/kiln_tool_1/definitions/N"}
    tree_props = defs["kiln_tool_2"]["properties"]
    assert tree_props["children"]["items"] == {"$ref": "#/$defs/kiln_tool_2"}
    assert tree_props["enum_data"] == {"enum": [{"$ref": "#"}]}  # data, not a reference
    assert defs["kiln_tool_3"]["properties"]["c"] == {"$ref": "#/$defs/kiln_tool_3/$defs/City"}
    check_structured_outputs(plan_tools(req([BOOK, COUNT, tree, other]), None, False).constraint)


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


@pytest.mark.parametrize("parameters, where", [
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}}},
     "at tools[1].function.parameters/properties/a;"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}},
     "in tools[1].function.parameters#/$defs/nope"),
])
def test_a_place_in_a_tools_schema_is_named_as_the_client_sent_it(parameters, where):
    """tool_choice "required" compiles every tool's parameters under one schema's $defs; an error
    at a place in them named that schema's internal /$defs/kiln_tool_1, which the client never
    sent (helper-56)."""
    import asyncio

    from kiln.entrypoints.openai.structured_fields import check_compiles

    plan = plan_tools(req([tool(), tool(name="g", parameters=parameters)], tool_choice="required"),
                      None, False)
    with pytest.raises(OpenAIError) as e:
        asyncio.run(check_compiles(plan.constraint, "tools"))
    assert where in str(e.value) and "kiln_tool" not in str(e.value)
