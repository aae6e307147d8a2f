// Airlock's JavaScript/TypeScript REPL for the code-interpreter server (server.py).
//
// Cells arrive as JSON lines on stdin: {"id", "code", "env", "typescript"} or {"reseed": true}.
// Messages go back as JSON lines on the pipe whose fd is $AIRLOCK_REPL_FD:
//   {"id", "type": "stdout"|"stderr", "text"}     process.stdout/stderr writes (console.*)
//   {"id", "type": "result", "data": {mime: value}, "is_main_result": true}
//   {"id", "type": "error", "name", "value", "traceback"}
//   {"id", "type": "done", "execution_count"}
// Cells run in this process's global context (vm.Script.runInThisContext), so variables,
// functions and imports persist between cells; the value of the last expression is the
// result (util.inspect as text/plain); a Promise is awaited first. TypeScript is stripped of
// its types first (module.stripTypeScriptTypes where node has it, else node's bundled amaro,
// reachable with --expose-internals in node 22.12). Top-level await uses node's own REPL
// rewrite (internal/repl/await, also through --expose-internals).
'use strict';

const fs = require('node:fs');
const path = require('node:path');
const util = require('node:util');
const vm = require('node:vm');
const crypto = require('node:crypto');
const nodeModule = require('node:module');
const readline = require('node:readline');

const OUT = Number(process.env.AIRLOCK_REPL_FD || 3);
delete process.env.AIRLOCK_REPL_FD;

let current = null; // id of the running cell
let count = 0;
let abortCell = null; // rejects the awaited result of the running cell on SIGINT

function send(msg) {
  const buf = Buffer.from(JSON.stringify(msg) + '\n');
  let off = 0;
  while (off < buf.length) {
    try {
      off += fs.writeSync(OUT, buf, off);
    } catch (e) {
      if (e.code !== 'EAGAIN') throw e;
    }
  }
}

function patchStream(stream, name) {
  stream.write = function (chunk, encoding, cb) {
    if (typeof encoding === 'function') {
      cb = encoding;
      encoding = undefined;
    }
    const text = typeof chunk === 'string' ? chunk : Buffer.from(chunk).toString(encoding || 'utf8');
    send({ id: current, type: name, text });
    if (typeof cb === 'function') process.nextTick(cb);
    return true;
  };
}
patchStream(process.stdout, 'stdout');
patchStream(process.stderr, 'stderr');

// Math.random backed by the OS's CSPRNG, so clones of one snapshot differ once reseeded.
let pool = Buffer.alloc(0);
let poolOff = 0;
function reseed() {
  pool = crypto.randomBytes(4096);
  poolOff = 0;
}
Math.random = function random() {
  if (poolOff + 7 > pool.length) reseed();
  const hi = pool.readUInt32BE(poolOff) >>> 5; // 27 bits
  const lo = pool.readUInt32BE(poolOff + 4) >>> 6; // 26 bits
  poolOff += 8;
  return (hi * 67108864 + lo) / 9007199254740992;
};

let stripTypes = null;
if (typeof nodeModule.stripTypeScriptTypes === 'function') {
  stripTypes = (code) => nodeModule.stripTypeScriptTypes(code, { mode: 'strip' });
} else {
  try {
    const amaro = require('internal/deps/amaro/dist/index');
    stripTypes = (code) => amaro.transformSync(code, { mode: 'strip-only' }).code;
  } catch (_) {
    stripTypes = null;
  }
}

let processTopLevelAwait = null;
try {
  processTopLevelAwait = require('internal/repl/await').processTopLevelAwait;
} catch (_) {
  processTopLevelAwait = null;
}

globalThis.require = nodeModule.createRequire(path.join(process.cwd(), '__airlock_repl__.js'));

process.on('SIGINT', () => {
  if (abortCell) abortCell(Object.assign(new Error('Execution interrupted'), { name: 'KeyboardInterrupt' }));
});
process.on('uncaughtException', (e) => {
  send({ id: current, type: 'stderr', text: 'Uncaught ' + (e && e.stack ? e.stack : String(e)) + '\n' });
});
process.on('unhandledRejection', (e) => {
  send({ id: current, type: 'stderr', text: 'Unhandled rejection: ' + (e && e.stack ? e.stack : String(e)) + '\n' });
});

function errorMessage(id, e) {
  if (e instanceof Error || (e && typeof e === 'object' && 'stack' in e)) {
    const name = e.code === 'ERR_SCRIPT_EXECUTION_INTERRUPTED' ? 'KeyboardInterrupt' : (e.name || 'Error');
    // Keep the cell's frames, drop this REPL's own.
    const lines = String(e.stack || '').split('\n');
    const cut = lines.findIndex((l, i) => i > 0 && /sigintHandlersWrap|node:vm|node_repl\.js/.test(l));
    const traceback = (cut > 0 ? lines.slice(0, cut) : lines).join('\n');
    return { id, type: 'error', name, value: String(e.message || ''), traceback };
  }
  return { id, type: 'error', name: 'Error', value: util.inspect(e), traceback: '' };
}

async function runCell(req) {
  const id = req.id;
  current = id;
  count += 1;
  const saved = {};
  for (const [k, v] of Object.entries(req.env || {})) {
    saved[k] = Object.prototype.hasOwnProperty.call(process.env, k) ? process.env[k] : undefined;
    process.env[k] = String(v);
  }
  try {
    let code = String(req.code || '');
    if (req.typescript) {
      if (!stripTypes) throw Object.assign(new Error('TypeScript needs node 22.12 or newer'), { name: 'TypeScriptUnavailable' });
      code = stripTypes(code);
    }
    let script;
    let wrapped = false;
    try {
      script = new vm.Script(code, { filename: `cell${count}` });
    } catch (e) {
      if (!(e instanceof SyntaxError && /await/.test(e.message))) throw e;
      // Top-level await: node's own REPL rewrite (declarations stay global, the last
      // expression comes back as {value}); without it, a plain async wrapper.
      const rewritten = processTopLevelAwait ? processTopLevelAwait(code) : null;
      if (rewritten) {
        script = new vm.Script(rewritten, { filename: `cell${count}` });
        wrapped = true;
      } else {
        script = new vm.Script(`(async () => {\n${code}\n})()`, { filename: `cell${count}` });
      }
    }
    let value = script.runInThisContext({ breakOnSigint: true, displayErrors: false });
    if (wrapped) {
      value = await new Promise((resolve, reject) => {
        abortCell = reject;
        value.then(resolve, reject);
      });
      value = value && typeof value === 'object' && 'value' in value ? value.value : undefined;
    }
    if (value && typeof value.then === 'function') {
      value = await new Promise((resolve, reject) => {
        abortCell = reject;
        value.then(resolve, reject);
      });
    }
    if (value !== undefined) {
      send({ id, type: 'result', data: { 'text/plain': util.inspect(value) }, is_main_result: true });
    }
  } catch (e) {
    send(errorMessage(id, e));
  } finally {
    abortCell = null;
    for (const [k, v] of Object.entries(saved)) {
      if (v === undefined) delete process.env[k];
      else process.env[k] = v;
    }
    send({ id, type: 'done', execution_count: count });
    current = null;
  }
}

let chain = Promise.resolve();
const rl = readline.createInterface({ input: process.stdin, crlfDelay: Infinity });
rl.on('line', (line) => {
  let req;
  try {
    req = JSON.parse(line);
  } catch (_) {
    return;
  }
  if (req.reseed) {
    chain = chain.then(() => reseed());
    return;
  }
  chain = chain.then(() => runCell(req));
});
rl.on('close', () => process.exit(0));
