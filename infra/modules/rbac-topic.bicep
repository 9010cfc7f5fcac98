// Service Bus data roles of one principal on one topic poller's topic, at the narrowest scope that
// works (rbac.bicep deploys this module once per topic, for the app and for the developer):
//   Azure Service Bus Data Sender    the topic            the poller sends batches; a worker's
//                                                         split and `dbfanout dlq replay` send
//                                                         targeted copies back to the topic
//   Azure Service Bus Data Receiver  each subscription    the subscription's trigger receives;
//                                                         the CLI peeks / replays its DLQ
// Never on the namespace: the identity reaches only its pollers' entities, not others there.
// Role ids are the documented built-in role definition GUIDs, written literally so that the gate's
// checks can read them. The table is not called `roles`: checkov resolves variables by name across
// files, and would read rbac.bicep's `roles.storageBlobDataOwner` from this table instead.

@description('Object (principal) id that receives the roles.')
param principalId string

@description('ServicePrincipal for a managed identity; User or Group for a developer.')
@allowed([
  'ServicePrincipal'
  'User'
  'Group'
])
param principalType string = 'ServicePrincipal'

@description('Service Bus namespace holding the topic.')
param serviceBusNamespaceName string

@description('The topic of one topic poller.')
param topicName string

@description('Its subscriptions, as in the topics parameter: [{name, ...}].')
param subscriptions array

var entityRoles = {
  serviceBusDataSender: '69a216fc-b8fb-44d8-bc22-1f3c2cd27a39'
  serviceBusDataReceiver: '4f6d3b9b-027b-4f4c-9142-0e5a2a2247e0'
}

resource namespace 'Microsoft.ServiceBus/namespaces@2024-01-01' existing = {
  name: serviceBusNamespaceName
}

resource topic 'Microsoft.ServiceBus/namespaces/topics@2024-01-01' existing = {
  parent: namespace
  name: topicName
}

resource topicSubscription 'Microsoft.ServiceBus/namespaces/topics/subscriptions@2024-01-01' existing = [for s in subscriptions: {
  parent: topic
  name: s.name
}]

resource senderOnTopic 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  scope: topic
  name: guid(topic.id, principalId, entityRoles.serviceBusDataSender)
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', entityRoles.serviceBusDataSender)
    principalId: principalId
    principalType: principalType
  }
}

resource receiverOnSubscription 'Microsoft.Authorization/roleAssignments@2022-04-01' = [for (s, i) in subscriptions: {
  scope: topicSubscription[i]
  name: guid(topicSubscription[i].id, principalId, entityRoles.serviceBusDataReceiver)
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', entityRoles.serviceBusDataReceiver)
    principalId: principalId
    principalType: principalType
  }
}]
