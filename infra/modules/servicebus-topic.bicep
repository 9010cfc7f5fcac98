// One topic poller's topic and its subscriptions (one per handler), in an existing namespace.
// servicebus.bicep deploys this module once per entry of its `topics` parameter: Bicep cannot
// nest resource loops, and a module per topic keeps to syntax checkov reads (no lambdas).
//
// The topic detects duplicates like a queue: the poller sends each batch once, with its
// idempotency key as message id, and every subscription gets one copy (the window rule at the top
// of servicebus.bicep applies unchanged). Each subscription has its own maxDeliveryCount, lock,
// sessions and dead-letter queue (<topic>/Subscriptions/<sub>/$DeadLetterQueue).
//
// Each subscription's `$Default` rule is replaced by the SQL filter dbfanout needs
// (shared/topology.py subscription_rule; tests/infra checks the two agree):
//   no filter:      [dbfanout-to] IS NULL OR [dbfanout-to] = '<sub>'
//   with filter F:  ([dbfanout-to] IS NULL AND (F)) OR [dbfanout-to] = '<sub>'
// A message without the `dbfanout-to` application property is for every subscription (that its
// filter accepts); the singles of a split and the DLQ replays of one subscription carry
// `dbfanout-to = <sub>` and reach that subscription only.

@description('Existing Service Bus namespace (Standard or Premium: Basic has no topics).')
param namespaceName string

@description('Topic name: topic = ... of the poller in dbfanout.toml.')
@minLength(1)
@maxLength(260)
param topicName string

@description('Duplicate detection window of the topic (see servicebus.bicep).')
param duplicateDetectionHistoryTimeWindow string

@description('Time to live of messages sent to the topic.')
param defaultMessageTimeToLive string = 'P14D'

@description('One entry per [pollers.X.subscriptions.NAME]: {name, maxDeliveryCount?, lockDuration?, requiresSession?, filter?, defaultMessageTimeToLive?}.')
param subscriptions array

// The user filter of each subscription ('' for none), by position. `s['filter']`, not `s.filter`:
// checkov's Bicep parser reads `filter` as the lambda function and cannot parse the file.
var filters = [for s in subscriptions: contains(s, 'filter') ? s['filter'] : '']

resource namespace 'Microsoft.ServiceBus/namespaces@2024-01-01' existing = {
  name: namespaceName
}

resource topic 'Microsoft.ServiceBus/namespaces/topics@2024-01-01' = {
  parent: namespace
  name: topicName
  properties: {
    // Message id = the batch's idempotency key; the broker drops a re-sent batch inside the window.
    requiresDuplicateDetection: true
    duplicateDetectionHistoryTimeWindow: duplicateDetectionHistoryTimeWindow
    defaultMessageTimeToLive: defaultMessageTimeToLive
    enablePartitioning: false
  }
}

resource topicSubscription 'Microsoft.ServiceBus/namespaces/topics/subscriptions@2024-01-01' = [for s in subscriptions: {
  parent: topic
  name: s.name
  properties: {
    // The subscription's dead-letter queue is its poison quarantine: nothing expires silently,
    // and a message its filter cannot evaluate is dead-lettered rather than dropped.
    deadLetteringOnMessageExpiration: true
    deadLetteringOnFilterEvaluationExceptions: true
    maxDeliveryCount: contains(s, 'maxDeliveryCount') ? s.maxDeliveryCount : 10
    lockDuration: contains(s, 'lockDuration') ? s.lockDuration : 'PT1M'
    requiresSession: contains(s, 'requiresSession') ? s.requiresSession : false
    defaultMessageTimeToLive: contains(s, 'defaultMessageTimeToLive') ? s.defaultMessageTimeToLive : defaultMessageTimeToLive
  }
}]

// Replaces the match-all `$Default` rule Service Bus creates with every subscription.
resource rule 'Microsoft.ServiceBus/namespaces/topics/subscriptions/rules@2024-01-01' = [for (s, i) in subscriptions: {
  parent: topicSubscription[i]
  name: '$Default'
  properties: {
    filterType: 'SqlFilter'
    sqlFilter: {
      sqlExpression: empty(filters[i]) ? '[dbfanout-to] IS NULL OR [dbfanout-to] = \'${s.name}\'' : '([dbfanout-to] IS NULL AND (${filters[i]})) OR [dbfanout-to] = \'${s.name}\''
    }
  }
}]

output name string = topic.name
output id string = topic.id
