// A client built on the official TypeScript MCP SDK, for tests/test_mcp_ts_client.py.
//
//   TS_SDK_PREFIX=<npm prefix> node tests/ts/client.mjs '<config JSON>'
//
// config: {url, key, sessions: [{capabilities: ["elicitation", "sampling", "roots"], steps: [...]}]}
// Each session connects with StreamableHTTPClientTransport (the key as a bearer header), declares
// the capabilities named, answers every question deterministically, runs its steps in order
// ({op: "list"} or {op: "call", name, args}), then ends its session (DELETE). Sessions run at once.
// Prints one JSON line: {sessions: [{id, protocol, asked: [...], results: [...]}]}, each result
// {tools: [names]} or {result: CallToolResult} or {error: {code, message}}.
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

const prefix = process.env.TS_SDK_PREFIX;
if (!prefix) throw new Error('TS_SDK_PREFIX names the npm prefix holding @modelcontextprotocol/sdk');
const sdk = join(prefix, 'node_modules', '@modelcontextprotocol', 'sdk', 'dist', 'esm');
const load = (path) => import(pathToFileURL(join(sdk, path)).href);  // ESM ignores NODE_PATH
const { Client } = await load('client/index.js');
const { StreamableHTTPClientTransport } = await load('client/streamableHttp.js');
const types = await load('types.js');

const config = JSON.parse(process.argv[2]);

async function session(spec) {
  const declared = new Set(spec.capabilities ?? []);
  const capabilities = {};
  if (declared.has('elicitation')) capabilities.elicitation = { form: {}, url: {} };
  if (declared.has('sampling')) capabilities.sampling = {};
  if (declared.has('roots')) capabilities.roots = { listChanged: true };
  const client = new Client({ name: 'ts-sdk-test-client', version: '1.0.0' }, { capabilities });
  const asked = [];
  if (declared.has('elicitation')) {
    client.setRequestHandler(types.ElicitRequestSchema, async (request) => {
      const mode = request.params.mode ?? 'form';
      asked.push(`elicit:${mode}`);
      return mode === 'url' ? { action: 'accept' } : { action: 'accept', content: { name: 'Ada' } };
    });
  }
  if (declared.has('sampling')) {
    client.setRequestHandler(types.CreateMessageRequestSchema, async (request) => {
      const first = request.params.messages[0]?.content;
      asked.push(`sample:${first?.type === 'text' ? first.text : '?'}`);
      return { role: 'assistant', model: 'ts-model', content: { type: 'text', text: 'ts waves' } };
    });
  }
  if (declared.has('roots')) {
    client.setRequestHandler(types.ListRootsRequestSchema, async () => {
      asked.push('roots');
      return { roots: [{ uri: 'file:///ts/work', name: 'work' }] };
    });
  }
  const transport = new StreamableHTTPClientTransport(new URL(config.url), {
    requestInit: { headers: { Authorization: `Bearer ${config.key}` } },
  });
  await client.connect(transport);
  const out = { id: transport.sessionId, protocol: transport.protocolVersion, asked, results: [] };
  try {
    for (const step of spec.steps) {
      try {
        if (step.op === 'list') {
          const listed = await client.listTools();
          out.results.push({ tools: listed.tools.map((t) => t.name) });
        } else {
          out.results.push({ result: await client.callTool({ name: step.name, arguments: step.args ?? {} }) });
        }
      } catch (e) {
        out.results.push({ error: { code: e.code ?? null, message: String(e.message ?? e) } });
      }
    }
  } finally {
    await transport.terminateSession().catch(() => {});
    await client.close();
  }
  return out;
}

const sessions = await Promise.all(config.sessions.map(session));
process.stdout.write(JSON.stringify({ sessions }) + '\n');
