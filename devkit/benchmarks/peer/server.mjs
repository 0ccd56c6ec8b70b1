// The sync engine's webhook endpoint, offline, for ops/bench (devkit/benchmarks/peer/__init__.py).
//
// What the package's own CLI mounts in `sync --listen-mode webhook`, without the parts that need
// the internet (an ngrok tunnel, registering the endpoint with Stripe): express, the raw body,
// StripeSync.webhook.processWebhook (verify the signature, upsert the object inline), then
// 200 {received: true}, or 400 {error} when it throws.
//
// Offline settings: the account id is given (else StripeSync.create asks GET /v1/account),
// revalidateObjectsViaStripeApi: [], backfillRelatedEntities: false, autoExpandLists: false; the
// tables come from the OpenAPI document at SYNC_OPENAPI_SPEC (else runMigrations downloads
// Stripe's). With STRIPE_API_URL set the package's Stripe client talks to that local server
// instead of api.stripe.com, so an unexpected call is counted there and never leaves the machine.
//
// The benchmark copies this file beside the package's node_modules (the cache directory it
// installs the package into), where `import '@stripe/sync-engine'` resolves.
//
// env: DATABASE_URL, PORT, WEBHOOK_PATH, STRIPE_WEBHOOK_SECRET, STRIPE_ACCOUNT_ID, POOL_MAX,
//      SYNC_OPENAPI_SPEC, STRIPE_API_URL (optional)
import express from 'express'
import { StripeSync, runMigrations } from '@stripe/sync-engine'

const env = process.env
const silent = { debug() {}, info() {}, warn: console.warn, error: console.error }

await runMigrations({ databaseUrl: env.DATABASE_URL, logger: silent, openApiSpecPath: env.SYNC_OPENAPI_SPEC })

const sync = await StripeSync.create({
  poolConfig: { connectionString: env.DATABASE_URL, max: Number(env.POOL_MAX || 10), keepAlive: true },
  stripeSecretKey: env.STRIPE_SECRET_KEY || 'sk_test_offline_bench_0000000000000000',
  stripeWebhookSecret: env.STRIPE_WEBHOOK_SECRET,
  stripeAccountId: env.STRIPE_ACCOUNT_ID || 'acct_offline_bench',
  revalidateObjectsViaStripeApi: [],
  backfillRelatedEntities: false,
  autoExpandLists: false,
  logger: silent,
})

if (env.STRIPE_API_URL) {
  const api = new URL(env.STRIPE_API_URL)
  sync.stripe._setApiField('protocol', api.protocol.slice(0, -1))
  sync.stripe._setApiField('host', api.hostname)
  sync.stripe._setApiField('port', api.port)
}

const path = env.WEBHOOK_PATH || '/webhooks/stripe'
const app = express()
app.post(path, express.raw({ type: 'application/json' }), async (req, res) => {
  const signature = req.headers['stripe-signature']
  if (typeof signature !== 'string' || !signature) {
    return res.status(400).send({ error: 'Missing stripe-signature header' })
  }
  if (!Buffer.isBuffer(req.body)) {
    return res.status(400).send({ error: 'Missing raw body for signature verification' })
  }
  try {
    await sync.webhook.processWebhook(req.body, signature)
    return res.status(200).send({ received: true })
  } catch (error) {
    console.error('[webhook] processing error:', error instanceof Error ? error.message : error)
    return res.status(400).send({ error: error instanceof Error ? error.message : 'Unknown error' })
  }
})
app.get('/health', (req, res) => res.status(200).json({ status: 'ok' }))

const server = app.listen(Number(env.PORT), '127.0.0.1', () => {
  console.log(`READY http://127.0.0.1:${env.PORT}${path} pid=${process.pid}`)
})
const stop = async () => {
  server.close()
  try { await sync.postgresClient.pool.end() } catch {}
  process.exit(0)
}
process.on('SIGTERM', stop)
process.on('SIGINT', stop)
