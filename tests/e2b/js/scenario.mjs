// The unchanged `e2b` npm package against a live airlockd's E2B gateway: the Python SDK's
// scenario (tests/e2b/test_sdk.py) in JavaScript. Run by tests/e2b.rs with E2B_API_KEY,
// E2B_API_URL and E2B_SANDBOX_URL set; exits non-zero at the first failed check.
import assert from 'node:assert/strict'
import { randomUUID } from 'node:crypto'
import { Sandbox, CommandExitError } from 'e2b'

for (const v of ['E2B_API_KEY', 'E2B_API_URL', 'E2B_SANDBOX_URL']) {
  assert.ok(process.env[v], `${v} is not set: run this through cargo test --test e2b`)
}
const RUN = { timeoutMs: 120_000, requestTimeoutMs: 120_000 }
const step = (name) => console.log(`- ${name}`)

const tag = randomUUID()
const sbx = await Sandbox.create('base', {
  timeoutMs: 600_000,
  metadata: { suite: tag },
  envs: { GREETING: 'hallo' },
  requestTimeoutMs: 120_000,
})
try {
  step('commands.run streams stdout and stderr to callbacks')
  const out = []
  const err = []
  const r = await sbx.commands.run('echo one; echo two >&2; echo $GREETING', {
    ...RUN,
    onStdout: (d) => out.push(d),
    onStderr: (d) => err.push(d),
  })
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'one\nhallo\n')
  assert.equal(r.stderr, 'two\n')
  assert.equal(out.join(''), r.stdout)
  assert.equal(err.join(''), r.stderr)

  step('a non-zero exit throws CommandExitError')
  await assert.rejects(sbx.commands.run('echo no >&2; exit 4', RUN), (e) => {
    assert.ok(e instanceof CommandExitError)
    assert.equal(e.exitCode, 4)
    assert.match(e.stderr, /no/)
    return true
  })

  step('a background command is waited for, another killed')
  const bg = await sbx.commands.run('for i in 1 2; do echo l$i; sleep 0.2; done', { ...RUN, background: true })
  assert.ok(bg.pid > 0)
  assert.equal((await bg.wait()).stdout, 'l1\nl2\n')
  const sleeper = await sbx.commands.run('sleep 300', { ...RUN, background: true })
  assert.ok((await sbx.commands.list()).some((p) => p.pid === sleeper.pid))
  assert.equal(await sleeper.kill(), true)
  await assert.rejects(sleeper.wait(), (e) => e instanceof CommandExitError && e.exitCode === -1)

  step('sendStdin reaches a running command')
  const reader = await sbx.commands.run('head -n 2', { ...RUN, background: true, stdin: true })
  await sbx.commands.sendStdin(reader.pid, 'a\n')
  await sbx.commands.sendStdin(reader.pid, 'b\n')
  assert.equal((await reader.wait()).stdout, 'a\nb\n')

  step('files: makeDir, write, read, list, exists, rename, remove')
  const d = `/home/user/js-${tag.slice(0, 8)}`
  assert.equal(await sbx.files.makeDir(d), true)
  assert.equal(await sbx.files.makeDir(d), false)
  await sbx.files.write(`${d}/a.txt`, 'from node')
  assert.equal(await sbx.files.read(`${d}/a.txt`), 'from node')
  assert.deepEqual((await sbx.files.list(d)).map((e) => e.name), ['a.txt'])
  assert.equal(await sbx.files.exists(`${d}/a.txt`), true)
  await sbx.files.rename(`${d}/a.txt`, `${d}/b.txt`)
  assert.equal(await sbx.files.exists(`${d}/a.txt`), false)
  assert.equal((await sbx.commands.run(`cat ${d}/b.txt`, RUN)).stdout, 'from node')
  await sbx.files.remove(`${d}/b.txt`)
  assert.equal(await sbx.files.exists(`${d}/b.txt`), false)

  step('setTimeout moves the end')
  await sbx.setTimeout(900_000)
  const left = (new Date((await sbx.getInfo()).endAt).getTime() - Date.now()) / 1000
  assert.ok(left > 850 && left <= 905, `${left}`)

  step('list by metadata')
  const found = await Sandbox.list({ query: { metadata: { suite: tag } } }).nextItems()
  assert.deepEqual(found.map((s) => s.sandboxId), [sbx.sandboxId])
} finally {
  step('kill')
  await sbx.kill()
}
assert.equal(await sbx.isRunning(), false)
assert.deepEqual(await Sandbox.list({ query: { metadata: { suite: tag } } }).nextItems(), [])
console.log('ok')
