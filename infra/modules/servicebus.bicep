// Service Bus namespace with one queue per dbfanout queue poller and one topic (with one
// subscription per handler, servicebus-topic.bicep) per topic poller. Local (SAS key) auth is
// disabled: the app sends and receives with its managed identity, scoped to each queue, topic and
// subscription in rbac.bicep. Topics need Standard or Premium (Basic has none; neither does the
// `sku` parameter allow it).
//
// Duplicate detection window (duplicateDetectionHistoryTimeWindow). A poller enqueues a batch and
// only then commits its checkpoint. When that commit fails (window W1) or its outcome is unknown
// (W5), the batch is enqueued again, with the same message id, by whichever instance owns the
// lease next. At the latest that happens after
//     lease_ttl_seconds            (the old lease must expire)
//   + one schedule interval        (the next timer tick)
//   + one tick's duration          (tick_budget_seconds, default 2/3 of the lease TTL)
// measured from the first send. The window must cover that sum with margin (we use x2), or the
// re-sent batch is delivered twice. lease_ttl 120 s, a 5 s schedule, an 80 s budget: 205 s, x2 =
// 410 s, so the default PT10M fits. Raise duplicateDetectionHistoryTimeWindow (namespace-wide
// default, or per queue or topic) when you raise lease_ttl_seconds or slow the schedule. Duplicate
// detection and sessions can only be chosen when a queue, topic or subscription is created.

@description('Service Bus namespace name (6-50 characters).')
@minLength(6)
@maxLength(50)
param name string

@description('Azure region.')
param location string

@description('Tags applied to the namespace.')
param tags object = {}

@description('Standard, or Premium for larger messages, isolation and VNet features (duplicate detection needs one of the two).')
@allowed([
  'Standard'
  'Premium'
])
param sku string = 'Standard'

@description('Messaging units when sku is Premium (1, 2, 4, 8 or 16).')
@allowed([
  1
  2
  4
  8
  16
])
param premiumCapacity int = 1

@description('One entry per poller queue: {name, maxDeliveryCount?, lockDuration?, requiresSession?, duplicateDetectionHistoryTimeWindow?, defaultMessageTimeToLive?}.')
param queues array

@description('One entry per topic poller: {name, duplicateDetectionHistoryTimeWindow?, defaultMessageTimeToLive?, subscriptions: [{name, maxDeliveryCount?, lockDuration?, requiresSession?, filter?, defaultMessageTimeToLive?}]}.')
param topics array = []

@description('Default duplicate detection window for queues and topics that do not set their own; see the rule at the top of this file.')
param duplicateDetectionHistoryTimeWindow string = 'PT10M'

var skuSettings = sku == 'Premium' ? {
  name: 'Premium'
  tier: 'Premium'
  capacity: premiumCapacity
} : {
  name: 'Standard'
  tier: 'Standard'
}

resource namespace 'Microsoft.ServiceBus/namespaces@2024-01-01' = {
  name: name
  location: location
  tags: tags
  sku: skuSettings
  properties: {
    disableLocalAuth: true
    minimumTlsVersion: '1.2'
    publicNetworkAccess: 'Enabled'
  }
}

resource queue 'Microsoft.ServiceBus/namespaces/queues@2024-01-01' = [for q in queues: {
  parent: namespace
  name: q.name
  properties: {
    // Message id = the batch's idempotency key; the broker drops a re-sent batch inside the window.
    requiresDuplicateDetection: true
    duplicateDetectionHistoryTimeWindow: contains(q, 'duplicateDetectionHistoryTimeWindow') ? q.duplicateDetectionHistoryTimeWindow : duplicateDetectionHistoryTimeWindow
    // The dead-letter queue is dbfanout's poison quarantine: nothing expires silently.
    deadLetteringOnMessageExpiration: true
    maxDeliveryCount: contains(q, 'maxDeliveryCount') ? q.maxDeliveryCount : 10
    lockDuration: contains(q, 'lockDuration') ? q.lockDuration : 'PT1M'
    requiresSession: contains(q, 'requiresSession') ? q.requiresSession : false
    defaultMessageTimeToLive: contains(q, 'defaultMessageTimeToLive') ? q.defaultMessageTimeToLive : 'P14D'
    enablePartitioning: false
  }
}]

// A topic, its subscriptions and their rules per topic poller (a module: resource loops cannot nest).
module topic './servicebus-topic.bicep' = [for (t, i) in topics: {
  name: '${deployment().name}-topic-${i}'
  params: {
    namespaceName: namespace.name
    topicName: t.name
    duplicateDetectionHistoryTimeWindow: contains(t, 'duplicateDetectionHistoryTimeWindow') ? t.duplicateDetectionHistoryTimeWindow : duplicateDetectionHistoryTimeWindow
    defaultMessageTimeToLive: contains(t, 'defaultMessageTimeToLive') ? t.defaultMessageTimeToLive : 'P14D'
    subscriptions: t.subscriptions
  }
}]

output name string = namespace.name
output id string = namespace.id
output fullyQualifiedNamespace string = '${namespace.name}.servicebus.windows.net'
